"""Trainer <-> rollout handshake: logprobs carry the contract they were computed under.

A rollout's logprobs and the trainer's agree bit for bit only when both sides run the
same contract: exactlogp's logprob contract (`exactlogp.CONTRACT`) and, for logits the
trainer recomputes from hidden states, the linear-logits contract
(`exactlogp.LOGITS_CONTRACT`). The rollout stamps its batch with `contract_fingerprint()`
(`stamp(meta)`); the trainer calls `check_fingerprint(meta)` before it compares or mixes
the rollout's logprobs with its own, and gets a ValueError naming both contracts when
they differ -- or when the rollout's logprobs carry no stamp at all.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import exactlogp

FINGERPRINT_KEY = "exactlogp_contract"

# logits contracts this exactlogp replaced, and what changed
LOGITS_CONTRACT_CHANGES = {
    "exactlogp-linear-v1": (
        "exactlogp-linear-v1 rounded every hidden and weight element to a 20-bit grid of "
        "its row's largest before the exact sum, so its logits were not the true dot "
        "products rounded once where a row held outlier channels or fp32 inputs; "
        "exactlogp-linear-v2's are, for every input."
    ),
}


def contract_fingerprint() -> str:
    """'<logprob contract>+logits:<linear-logits contract>' of this exactlogp."""
    return f"{exactlogp.CONTRACT}+logits:{exactlogp.LOGITS_CONTRACT}"


def stamp(meta: MutableMapping) -> MutableMapping:
    """Put this process's fingerprint in a rollout batch's metadata; returns `meta`."""
    meta[FINGERPRINT_KEY] = contract_fingerprint()
    return meta


def check_fingerprint(meta: Mapping | str | None, *, what: str = "the rollout's logprobs") -> None:
    """Raise ValueError unless `meta` (a stamped mapping, or the fingerprint itself) was
    made under this process's contract."""
    theirs = meta.get(FINGERPRINT_KEY) if isinstance(meta, Mapping) else meta
    ours = contract_fingerprint()
    if theirs is None:
        raise ValueError(
            f"{what} carry no exactlogp contract fingerprint ({FINGERPRINT_KEY}): they may "
            f"not be exactlogp's; stamp them on the rollout side with "
            f"exactlogp.integrations.handshake.stamp(meta) (this trainer runs {ours})"
        )
    old = [c for c in LOGITS_CONTRACT_CHANGES if f"logits:{c}" in str(theirs)]
    if old:
        raise ValueError(
            f"{what} were computed under {theirs!r}, this trainer runs {ours!r}: "
            f"{LOGITS_CONTRACT_CHANGES[old[0]]} Their logits (and logprobs) differ in the "
            "last bits wherever that happened; recompute the rollout with this exactlogp "
            "(pin the same exactlogp version on both sides)"
        )
    if theirs != ours:
        raise ValueError(
            f"{what} were computed under {theirs!r}, this trainer runs {ours!r}: their bits "
            "cannot be compared; run the same exactlogp contract on both sides"
        )
