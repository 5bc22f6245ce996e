import torch

import exactlogp


def test_contract_version():
    assert exactlogp.CONTRACT == "exactlogp-v1"


def test_tp1_matches_fp64_log_softmax_on_a_small_row():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    res = exactlogp.selected_logprobs(x, torch.tensor([2]))
    expected = torch.log_softmax(x.double(), -1)[0, 2].float()
    assert torch.equal(res.logprobs[0], expected)
