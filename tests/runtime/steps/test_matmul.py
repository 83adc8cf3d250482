"""A matmul and its epilogue in one step (runtime.steps.matmul): bias folded into the GEMM, relu in place with
where()'s semantics (NaN -> 0, inf kept), the rest as a fused kernel. Compared with the interpreter on 2 ranks,
with NaN and inf in the input."""

import torch

import cocosync as cs
from cocosync.dsl import Replicated, Sliced, Tensor, gt, where

R, K, N = 6, 8, 12


def _relu(a):
    return where(gt(a, 0.0), a, 0.0)


def _programs():
    def make(name, outs_of):
        x = Tensor("x", (R, K), torch.float32, Replicated)
        w = Tensor("w", (K, N), torch.float32, Sliced(1))
        b = Tensor("b", (N,), torch.float32, Sliced(0))
        return cs.Program(name, [x, w, b], outs_of(x @ w, b))

    from cocosync.programs.model_parallel import megatron_mlp_program
    from cocosync.schedule.standard import megatron_schedule

    return {
        # the paper's block without overlap: relu(x @ w1) and the scatter of x merged into the GEMM's step
        "megatron": megatron_schedule(megatron_mlp_program(R, K, N, p=0.1), chunks=1).program,
        # bias and relu fold into the GEMM; a tail kernel reads the relu
        "relu_tail": make("relu_tail", lambda m, b: (lambda h: {"h": h, "h3": h * 3.0})(_relu(m + b))),
        # the biased value is read outside: bias folds, relu stays in the tail kernel
        "bias_only": make("bias_only", lambda m, b: (lambda a: {"a": a, "r": _relu(a)})(m + b)),
        # relu written as maximum(t, 0) (NaN stays NaN, as relu_ does)
        "max_relu": make("max_relu", lambda m, b: {"o": cs.maximum(m + b, 0.0) * 2.0}),
        # the product itself is an output: nothing folds, the add runs as the GEMM's epilogue kernel
        "nothing": make("nothing", lambda m, b: {"m": m, "mb": m + b}),
    }


FOLDS = {"megatron": ("relu",), "relu_tail": ("bias", "relu"), "bias_only": ("bias",), "max_relu": ("bias", "relu"),
         "nothing": ()}  # what folds into the GEMM call


def _inputs(name):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(R, K, generator=gen)
    x[1, 2], x[3, 0] = float("nan"), float("inf")  # rows of NaN (and +-inf / NaN) after the GEMM
    if name == "megatron":  # x (R, K) -> w1 (K, N) -> w2 (N, K); b (K,)
        return {"x": x, "w1": torch.randn(K, N, generator=gen), "w2": torch.randn(N, K, generator=gen),
                "b": torch.randn(K, generator=gen)}
    return {"x": x, "w": torch.randn(K, N, generator=gen), "b": torch.randn(N, generator=gen)}


def _on_rank():
    import torch.distributed as dist

    from cocosync.interp import rank_inputs

    out = {}
    for name, program in _programs().items():
        fn = cs.compile_scheduled(program, kernels="eager")
        got = fn(**rank_inputs(program, 2, _inputs(name), dist.get_rank()))
        folds = getattr(fn.runners[0], "folds", None)
        out[name] = ({k: v.clone() for k, v in got.items()}, folds, [str(s) for s in fn.plan.steps])
    return out


def test_matmul_epilogue_matches_oracle_with_nan_and_inf(rank_pool):
    got = rank_pool(2).run(_on_rank)
    for name, program in _programs().items():
        want = cs.interpret(program, 2, _inputs(name))
        for r in range(2):
            values, folds, steps = got[r][name]
            assert steps[0].startswith("kernel(matmul1, "), steps  # one step: GEMM + epilogue
            assert folds == FOLDS[name], (name, folds)
            for out, v in want[r].items():
                torch.testing.assert_close(values[out], v, rtol=1e-5, atol=1e-5, equal_nan=True,
                                           msg=lambda m: f"{name}.{out} rank {r}: {m}")
    h = torch.cat([cs.interpret(_programs()["relu_tail"], 2, _inputs("relu_tail"))[r]["h"] for r in range(2)], 1)
    assert not h.isnan().any() and h.isinf().any()  # where() turned NaN into 0 and kept inf: the case is exercised


def test_batched_matmul_is_left_to_the_reference():
    from cocosync.lower import lower
    from cocosync.runtime.steps.matmul import matmul_runner

    x = Tensor("x", (2, R, K), torch.float32, Replicated)
    w = Tensor("w", (K, N), torch.float32, Replicated)
    b = Tensor("b", (N,), torch.float32, Replicated)
    program = cs.Program("batched", [x, w, b], {"o": _relu(x @ w + b)})
    step = lower(program).steps[0]
    assert str(step).startswith("kernel(matmul1") and matmul_runner(step, program, None, "eager", set()) is None
