PROCESSED_LOGPROBS_MODES = ("processed_logits", "processed_logprobs")
