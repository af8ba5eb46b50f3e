"""The seed's own check: on bf16 q [1, 24, S, 128], 1D / 2D / 3D RoPE with half or interleave
rotations, the op equals the fp32 matrix form ``q.float() * cos + (q.float() @ mat) * sin`` rounded
to bf16, within 1 bf16 ulp. Prints the max absolute and relative errors (run with -s to see them).
"""

import pytest
import torch

import rome

SHAPE = (1, 24, 64, 128)  # [B, N, S, D]
GRIDS = {  # sizes of the position grid (S = their product) and lanes per axis
    "1D": ([64], [128]),
    "2D": ([8, 8], [64, 64]),
    "3D": ([4, 4, 4], [44, 44, 40]),
}


def tables_for(variant, mode):
    sizes, dims = GRIDS[variant]
    layout = "half" if mode == "half" else "pairs"
    if len(sizes) == 1:
        return rome.tables.rope_table(sizes[0], dims[0], layout=layout)
    return rome.tables.grid_table(sizes, dims, layout=layout)


def ulp_bf16(v):
    """The bf16 unit in the last place at |v| (the subnormal spacing near zero)."""
    tiny = torch.finfo(torch.bfloat16).tiny
    mag = v.abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


@pytest.mark.parametrize("table_dtype", (torch.float32, torch.bfloat16), ids=("fp32_tables", "bf16_tables"))
@pytest.mark.parametrize("mode", ("half", "interleave"))
@pytest.mark.parametrize("variant", sorted(GRIDS))
def test_seed_check(variant, mode, table_dtype, isa):
    q = torch.randn(SHAPE).to(torch.bfloat16)
    cos, sin = (t.to(table_dtype) for t in tables_for(variant, mode))
    dims = GRIDS[variant][1]
    mat = rome.matrices.block_diag(dims, kind=mode)  # one block for 1D
    expected = (q.float() * cos.float() + (q.float() @ mat) * sin.float()).to(torch.bfloat16)

    outputs = {
        "rope_matrix": rome.rope_matrix(q, mat, sin, cos),
        "rope": rome.rope(q, None, cos, sin, rotation=mode, blocks=dims if len(dims) > 1 else None)[0],
    }
    inplace = q.clone()
    rome.rope_matrix_(inplace, mat, sin, cos)
    outputs["rope_matrix_"] = inplace

    ref = expected.double()
    for name, out in outputs.items():
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        err = (out.double() - ref).abs()
        rel = (err / ref.abs().clamp_min(1e-30))[ref != 0]
        ulps = err / ulp_bf16(torch.maximum(out.double().abs(), ref.abs()))
        print(f"[seed check] {variant} {mode} {str(table_dtype)[6:]} tables {name} on {isa}: "
              f"max abs error {float(err.max()):.3e}, max rel error {float(rel.max()):.3e}, "
              f"max {float(ulps.max()):.0f} ulp, {int((err > 0).sum())} of {err.numel()} elements differ")
        assert float(ulps.max()) <= 1.0, f"{name}: {float(ulps.max())} bf16 ulp"
