"""Stand-in: slime/backends/megatron_utils/loss.py of THUDM/slime@624b824, reduced to what
`patch_slime` must reach: the module binds `calculate_log_probs_and_entropy` by name
(`from slime.utils.ppo_utils import calculate_log_probs_and_entropy`, with other names),
and `get_log_probs_and_entropy` looks that binding up when it runs.

The real module imports megatron-core (`from megatron.core import mpu`) and slime's CP,
top-p and per-sample helpers; `score_rows` here keeps only the two steps of its
`get_log_probs_and_entropy` that touch the logits -- the division by
`args.rollout_temperature` (in fp32, when it is not 1.0) and the call -- with the keep mask
given directly instead of built from `rollout_top_p_token_ids` / `_offsets`.
"""

from slime.utils.ppo_utils import calculate_log_probs_and_entropy


def score_rows(
    logits,
    tokens,
    tp_group,
    *,
    rollout_temperature=1.0,
    with_entropy=False,
    with_entropy_grad=True,
    chunk_size=-1,
    log_prob_keep_mask=None,
):
    if rollout_temperature != 1.0:
        logits = logits / rollout_temperature
    return calculate_log_probs_and_entropy(
        logits,
        tokens,
        tp_group,
        with_entropy=with_entropy,
        with_entropy_grad=with_entropy_grad,
        chunk_size=chunk_size,
        log_prob_keep_mask=log_prob_keep_mask,
    )
