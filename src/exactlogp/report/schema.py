"""JSON Schema of the report file (draft 2020-12); `validate` raises on any mismatch.

Keys shared with the seed prior-art report keep the seed's meaning: tp4_equals_tp1,
nccl_setting_invariant, batch_bitwise, distinct_results_in_repeats, repeats, reference,
max_abs_vs_fp64, max_abs_vs, latency_us_tp4, and {"unavailable": text} for a candidate
that cannot run. The fused LM-head rows (entry "workload": "hidden_states") use the same
keys on the hidden-state workload, described in the header's "hidden_states", against its
own fp64 truth ("reference": "lm_head_fp64").
"""

from __future__ import annotations

NUM = {"type": "number"}
OPT_NUM = {"type": ["number", "null"]}
OPT_BOOL = {"type": ["boolean", "null"]}
STR = {"type": "string"}
OPT_STR = {"type": ["string", "null"]}
INT = {"type": "integer", "minimum": 0}
BY_TP = lambda value: {  # noqa: E731  -- {"<tp>": value}
    "type": "object",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": value,
}

LATENCY = {
    "type": "object",
    "required": ["median", "p10", "p90", "runs"],
    "properties": {"median": NUM, "p10": NUM, "p90": NUM, "runs": INT},
}

WORKLOAD = {"enum": ["logits", "hidden_states"]}  # candidates.base.WORKLOADS

UNAVAILABLE = {
    "type": "object",
    "required": ["unavailable"],
    "properties": {"unavailable": STR, "workload": WORKLOAD},
    "additionalProperties": False,
}

MEASURED = {
    "type": "object",
    "required": [
        "summary",
        "implementation",
        "workload",
        "tp_measured",
        "tp4_equals_tp1",
        "tp_equals_tp1",
        "nccl_setting_invariant",
        "nccl_settings_mismatched_rows",
        "float_all_reduces_per_call",
        "batch_bitwise",
        "batch_mismatched_rows",
        "distinct_results_in_repeats",
        "repeats",
        "ranks_agree",
        "reference",
        "max_abs_vs_fp64",
        "max_ulp_vs_fp64",
        "max_abs_vs",
        "latency_us",
        "peak_memory_mib_per_rank",
        "padded_vocab",
    ],
    "properties": {
        "summary": STR,
        "implementation": {"enum": ["ours", "real", "re-implementation"]},
        "note": STR,
        "workload": WORKLOAD,
        "backend": STR,
        "backend_resolved": STR,
        "tp_measured": {"type": "array", "items": INT},
        "errors": BY_TP(STR),
        "tracebacks": BY_TP(STR),
        "measure_wall_s": BY_TP(NUM),
        "details": {"type": "object"},
        "tp4_equals_tp1": OPT_BOOL,
        "tp_equals_tp1": BY_TP({"type": "boolean"}),
        "nccl_setting_invariant": OPT_BOOL,
        "nccl_settings_mismatched_rows": BY_TP(
            {"type": "object", "additionalProperties": {"type": "integer"}}
        ),
        "float_all_reduces_per_call": BY_TP(INT),
        "batch_bitwise": OPT_BOOL,
        "batch_mismatched_rows": BY_TP(
            {
                "type": "object",
                "required": ["alone", "sub_batches", "permuted", "among_extra_rows"],
                "additionalProperties": INT,
            }
        ),
        "distinct_results_in_repeats": {"type": ["integer", "null"], "minimum": 1},
        "repeats": {"type": ["integer", "null"], "minimum": 1},
        "ranks_agree": OPT_BOOL,
        "reference": {"enum": ["shared_logits_fp64", "lm_head_fp64"]},
        "max_abs_vs_fp64": OPT_NUM,
        "max_ulp_vs_fp64": OPT_NUM,
        "max_abs_vs": {"type": "object", "additionalProperties": NUM},
        "latency_us": BY_TP(LATENCY),
        "peak_memory_mib_per_rank": BY_TP({"type": "array", "items": OPT_NUM}),
        "padded_vocab": BY_TP(INT),
        "bitwise_equal_to_exactlogp": OPT_BOOL,
    },
    "patternProperties": {"^latency_us_tp[0-9]+$": NUM},
    "additionalProperties": {"not": {}},
}

HIDDEN_STATES = {
    "type": "object",
    "required": [
        "tokens",
        "hidden",
        "vocab",
        "dtype",
        "workload",
        "reference",
        "check_rows",
        "extra_rows",
    ],
    "properties": {
        "tokens": {"type": "integer", "minimum": 1},
        "hidden": {"type": "integer", "minimum": 1},
        "vocab": {"type": "integer", "minimum": 1},
        "dtype": {"enum": ["bf16", "fp16", "fp32"]},
        "workload": {"type": "object", "required": ["generator", "seed", "distribution"]},
        "reference": {
            "type": "object",
            "required": ["name", "method"],
            "properties": {"name": {"const": "lm_head_fp64"}, "method": STR},
        },
        "check_rows": {"type": "array", "items": INT},
        "extra_rows": {"type": "array", "items": INT},
    },
    "additionalProperties": False,
}

SETTING = {
    "type": "object",
    "required": ["name", "description"],
    "properties": {"name": STR, "description": STR},
    "additionalProperties": OPT_STR,
}

PROCESSED_ROW = {
    "type": "object",
    "required": [
        "implementation",
        "cut_tp_equals_tp1",
        "logprobs_tp_equals_tp1",
        "batch_bitwise",
        "distinct_results_in_repeats",
        "rows_cut_differs_from_truth",
        "dropped_targets",
        "max_abs_vs_fp64",
        "max_ulp_vs_fp64",
        "mean_abs_log_ratio_vs_fp64",
    ],
    "properties": {
        "implementation": STR,
        "cut_tp_equals_tp1": OPT_BOOL,
        "logprobs_tp_equals_tp1": OPT_BOOL,
        "batch_bitwise": {"type": "boolean"},
        "distinct_results_in_repeats": {"type": "integer", "minimum": 1},
        "rows_cut_differs_from_truth": INT,
        "dropped_targets": INT,
        "max_abs_vs_fp64": OPT_NUM,
        "max_ulp_vs_fp64": OPT_NUM,
        "mean_abs_log_ratio_vs_fp64": OPT_NUM,
    },
    "additionalProperties": False,
}

PROCESSED = {  # report/processed.py
    "type": "object",
    "required": ["tokens", "vocab", "dtype", "temperature", "top_k", "top_p", "min_p", "tp",
                 "check_rows", "repeats", "truth", "rows_in_workload_cut_by_truth", "rows"],
    "properties": {
        "tokens": {"type": "integer", "minimum": 1},
        "vocab": {"type": "integer", "minimum": 1},
        "tp": {"type": "integer", "minimum": 1},
        "truth": STR,
        "rows": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {
                "oneOf": [
                    PROCESSED_ROW,
                    {"type": "object", "required": ["unavailable"],
                     "properties": {"unavailable": STR}, "additionalProperties": False},
                ]
            },
        },
    },
}  # fmt: skip

REPORT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "exactlogp conformance report",
    "type": "object",
    "required": [
        "kind",
        "schema_version",
        "contract",
        "exactlogp_version",
        "created",
        "command",
        "project_commit",
        "tracked_tree_dirty",
        "environment",
        "third_party",
        "tokens",
        "vocab",
        "dtype",
        "collective_backend",
        "launcher",
        "tp",
        "nccl_settings",
        "nccl_settings_emulated",
        "workload",
        "reference",
        "method",
        "candidates",
        "wall_s",
    ],
    "properties": {
        "kind": {"const": "logprob_conformance"},
        "schema_version": {"const": 1},
        "contract": STR,
        "exactlogp_version": STR,
        "created": STR,
        "command": STR,
        "project_commit": OPT_STR,
        "tracked_tree_dirty": OPT_BOOL,
        "environment": {
            "type": "object",
            "required": [
                "device",
                "torch",
                "collective_backend",
                "nccl",
                "vllm",
                "python",
                "cpu_count",
            ],
            "properties": {
                "device": STR,
                "torch": STR,
                "collective_backend": {"enum": ["gloo", "nccl"]},
                "nccl": OPT_STR,
                "vllm": OPT_STR,
                "python": STR,
                "cpu_count": {"type": ["integer", "null"]},
            },
        },
        "third_party": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "version"],
                "properties": {"name": STR, "version": OPT_STR},
            },
        },
        "tokens": {"type": "integer", "minimum": 1},
        "vocab": {"type": "integer", "minimum": 1},
        "dtype": {"enum": ["bf16", "fp16", "fp32"]},
        "collective_backend": {"enum": ["gloo", "nccl"]},
        "launcher": {"enum": ["spawn", "torchrun"]},
        "tp": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
        "nccl_settings": {"type": "array", "items": SETTING, "minItems": 1},
        "nccl_settings_emulated": {"type": "boolean"},
        "workload": {"type": "object", "required": ["generator", "seed", "distribution"]},
        "reference": {"type": "object", "required": ["name", "method"]},
        "method": {"type": "object"},
        "hidden_states": HIDDEN_STATES,  # present when a row takes the hidden-state workload
        "processed": PROCESSED,  # the processed-logprobs table, unless it was left out
        "candidates": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {"oneOf": [UNAVAILABLE, MEASURED]},
        },
        "wall_s": NUM,
    },
}


def validate(report: dict) -> None:
    """Raise jsonschema.ValidationError if `report` does not match REPORT."""
    import jsonschema

    jsonschema.validate(report, REPORT, cls=jsonschema.Draft202012Validator)
