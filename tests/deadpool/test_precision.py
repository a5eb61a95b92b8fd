"""Precision settings: dtypes, validation, and the TF32 switch (set only for CUDA runs)."""

import pytest
import torch

from deadpool.rank.precision import apply_tf32, check, grad_reduce_dtype, param_dtype


def test_dtypes_and_defaults():
    assert param_dtype({}) == torch.float32 and grad_reduce_dtype({}) == torch.float32
    assert param_dtype({"precision": "bf16"}) == torch.bfloat16
    assert grad_reduce_dtype({"grad_reduce_dtype": "bf16"}) == torch.bfloat16


@pytest.mark.parametrize("bad,msg", [({"precision": "fp16"}, "precision must be one of"),
                                     ({"grad_reduce_dtype": "fp8"}, "grad_reduce_dtype"),
                                     ({"tf32": "yes"}, "tf32 must be true or false")])
def test_check_names_the_field(bad, msg):
    with pytest.raises(ValueError, match=msg):
        check(bad)


def test_tf32_is_a_separate_switch_for_cuda_runs():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        apply_tf32({"device": "cuda", "tf32": True})
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        apply_tf32({"device": "cpu", "tf32": False})  # a CPU run leaves torch's switches alone
        assert torch.backends.cuda.matmul.allow_tf32
        apply_tf32({"device": "cuda:0"})  # default: off
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
