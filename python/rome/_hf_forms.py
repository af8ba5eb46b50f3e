"""The RoPE functions transformers' modeling modules define, beyond the Llama one, and RoME's
replacement for each.

A module's ``apply_rotary_pos_emb`` (or MLA's ``apply_rotary_pos_emb_interleave``, Llama-4's and
DeepSeek-V2's complex-frequency ``apply_rotary_emb``, a vision tower's
``apply_rotary_pos_emb_vision``) is served only when its syntax tree equals one of the templates
below once every helper it calls is renamed to the canonical name (ROTATE_HALF, ROTATE_PAIRS,
APPLY_HALVES, STACK_FREQS, ...) of the helper whose syntax tree and argument list it has, looked
up in the function's own globals. So ``ROTATE_PAIRS(q)`` in a template means "q passed to a
function, whatever its name, that is the pair rotation", never a guess from a name.

Each replacement runs RoME's op and falls back to the module's own function (same arguments)
where the op refuses the inputs (float64, not on the CPU, tables that would broadcast q to a
larger shape or rank, ...) and under ``torch.compile`` (where a refusal raises while tracing,
with no fallback to catch it), so a patched model never fails where the original would not.
"""

import ast
import inspect
import textwrap
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from . import ops

# ------------------------------------------------------------------------------------------------
# Helper functions, by canonical name (several spellings each).

HELPERS: Dict[str, Tuple[str, ...]] = {
    # NeoX rotate_half: lanes [x1 | x2] -> [-x2 | x1].
    "ROTATE_HALF": ("""
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
""",),
    # GPT-J pairs: (x0, x1) -> (-x1, x0) per pair (Cohere, GLM, Helium, Ernie, DeepSeek-V4, ...).
    "ROTATE_PAIRS": ("""
def rotate_half(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)
""", """
def rotate_half(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return rot_x
""", """
def rotate_pairwise(x):
    x = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(start_dim=-2)
"""),
    # NanoChat: [x1 | x2] -> [x2 | -x1], i.e. the rotation by -angle.
    "ROTATE_HALF_NEGATED": ("""
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)
""",),
    # GPT-J / CodeGen: pairs on a rank-4 tensor.
    "ROTATE_EVERY_TWO_4D": ("""
def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)
""",),
    # gpt-oss: the half rotation with half-width tables.
    "APPLY_HALVES": ("""
def _apply_rotary_emb(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)
""",),
    # OpenAI privacy filter: the pair rotation with half-width tables.
    "APPLY_PAIRS": ("""
def _apply_rotary_emb(x, cos, sin):
    first_half, second_half = x[..., ::2], x[..., 1::2]
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.stack((first_, second_), dim=-1).flatten(-2)
""",),
    # Perception Encoder: 2x2 rotation matrices from the first half of the tables.
    "STACK_FREQS": ("""
def stack_freqs(cos, sin):
    dim = cos.size(-1)
    cos = cos.narrow(-1, 0, dim // 2)
    sin = sin.narrow(-1, 0, dim // 2)
    freqs_cis = torch.stack((cos, -sin, sin, cos), dim=-1).view(*cos.size(), 2, 2)
    return freqs_cis
""",),
}


def function_def(source: str) -> Optional[ast.FunctionDef]:
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    return fns[0] if len(fns) == 1 else None


def body_key(fn: ast.FunctionDef) -> str:
    """The function's statements without docstring, annotations or formatting."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return "\n".join(ast.dump(stmt, annotate_fields=False) for stmt in body)


def source_of(obj) -> Optional[str]:
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (TypeError, OSError, ValueError):
        return None


def key_of(source: str) -> Optional[str]:
    fn = function_def(source)
    return None if fn is None else body_key(fn)


def helper_key(source: str) -> Optional[Tuple[Tuple[str, ...], str]]:
    """(argument names, body key): a helper with its arguments reordered is another function."""
    fn = function_def(source)
    if fn is None:
        return None
    args = fn.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or args.defaults:
        return None
    return tuple(a.arg for a in args.args), body_key(fn)


_HELPER_BY_KEY = {helper_key(src): name for name, sources in HELPERS.items() for src in sources}
_HELPER_CACHE: Dict[object, Optional[str]] = {}


def helper_kind(obj) -> Optional[str]:
    """The canonical name of the helper `obj` is (by syntax tree), or None."""
    if not inspect.isfunction(inspect.unwrap(obj)):
        return None
    if obj not in _HELPER_CACHE:
        _HELPER_CACHE[obj] = _HELPER_BY_KEY.get(helper_key(source_of(obj) or ""))
    return _HELPER_CACHE[obj]


def namespace_of(function) -> Optional[dict]:
    """The globals `function`'s names resolve in (its defining module's, wherever it is
    imported)."""
    return getattr(inspect.unwrap(function), "__globals__", None)


def canonical_key(fn: ast.FunctionDef, namespace: dict) -> str:
    """body_key(fn) with each name of a known helper in `namespace` replaced by its kind."""

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            value = namespace.get(node.id)
            kind = None if value is None else helper_kind(value)
            return ast.copy_location(ast.Name(id=kind, ctx=node.ctx), node) if kind else node

    return body_key(Rename().visit(fn))


def signature(fn: ast.FunctionDef) -> Tuple[List[str], list, Optional[str]]:
    """(argument names, default values, **kwargs name); ([], [], None) for forms never served."""
    args = fn.args
    if args.vararg or args.kwonlyargs or args.posonlyargs:
        return [], [], None
    defaults = [ast.literal_eval(d) if isinstance(d, ast.Constant) else object()
                for d in args.defaults]
    return [a.arg for a in args.args], defaults, (args.kwarg.arg if args.kwarg else None)


# ------------------------------------------------------------------------------------------------
# The RoME calls.

_ROPE = ops._EAGER_ROPE  # eager only: make_replacement runs the original while tracing
# What RoME's op raises on inputs it does not take (it validates before writing anything), and
# what the argument handling below raises on calls the original would reject too.
_REFUSALS = (ValueError, IndexError, NotImplementedError, TypeError, RuntimeError)


def _rope(x, other, cos, sin, rotation="half", rotary_dim=-1, width="full"):
    """RoME on x and other (None, or a tensor of x's dtype or its own): (x_out, other_out)."""
    if cos.dim() > x.dim() or (other is not None and cos.dim() > other.dim()):
        # transformers' broadcast would give a result of the tables' rank; RoME keeps x's.
        raise ValueError("tables of a higher rank than x")
    if other is None:
        return _ROPE(x, None, cos, sin, None, rotation, (), rotary_dim, width, (), None, None)[0], \
            None
    if other.dtype == x.dtype:
        out = _ROPE(x, other, cos, sin, None, rotation, (), rotary_dim, width, (), None, None)
        return out[0], out[1]
    return (_ROPE(x, None, cos, sin, None, rotation, (), rotary_dim, width, (), None, None)[0],
            _ROPE(other, None, cos, sin, None, rotation, (), rotary_dim, width, (), None, None)[0])


def _promoted(x, cos, sin):
    """x in the dtype of ``x * cos + ... * sin`` (transformers' result dtype)."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return x if x.dtype == dtype else x.to(dtype)


def _same_dtype(q, k):
    """Forms computing k in fp32 and rounding it to q's dtype: RoME rounds once into k's own
    dtype, so both must agree (else the original runs)."""
    if k is not None and k.dtype != q.dtype:
        raise ValueError("k's dtype differs from q's")


def _half_table(t):
    """``t[..., : t.shape[-1] // 2]``: the distinct columns of a NeoX-layout table, read by the
    kernel as a "pairs" table instead of repeat_interleave'd."""
    return t[..., : t.shape[-1] // 2]


def _whole(x, rotary_dim):
    if rotary_dim != x.shape[-1]:
        raise ValueError("tables do not cover the head dim")


# Upcasting Llama (OLMo, OLMo-2/3, FlexOlmo, LFM-3, Beam): each result in its input's dtype.
def _half_each_own_dtype(q, k, cos, sin, unsqueeze_dim=1):
    return _rope(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


# fp32 math, both results in q's dtype (ESM, ModernBERT, Evolla, HunYuan-VL).
def _half_fp32_as_q(q, k, cos, sin, unsqueeze_dim=1):
    _same_dtype(q, k)
    return _rope(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


# Cohere, EfficientLoFTR, LightGlue, Ernie-4.5-VL: pairs, full tables, fp32, q's dtype.
def _pairs_fp32_as_q(q, k, cos, sin, unsqueeze_dim=1):
    _same_dtype(q, k)
    return _rope(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), "interleave")


# BLT: Llama's math with the pair rotate_half, full tables.
def _pairs_full(q, k, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "interleave")


# GLM, GLM-4, Moonshine: pairs on the first 2 * (W // 2) lanes from a NeoX-layout table.
def _pairs_from_half_table_partial(q, k, cos, sin, unsqueeze_dim=1):
    c, s = _half_table(cos.unsqueeze(unsqueeze_dim)), _half_table(sin.unsqueeze(unsqueeze_dim))
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "interleave", 2 * c.shape[-1],
                 "pairs")


# Helium: the same on every lane.
def _pairs_from_half_table(q, k, cos, sin, unsqueeze_dim=1):
    c, s = _half_table(cos.unsqueeze(unsqueeze_dim)), _half_table(sin.unsqueeze(unsqueeze_dim))
    _whole(q, 2 * c.shape[-1])
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "interleave", -1, "pairs")


# Ernie-4.5: Helium's math in fp32, both results in q's dtype.
def _pairs_from_half_table_fp32_as_q(q, k, cos, sin, unsqueeze_dim=1):
    _same_dtype(q, k)
    c, s = _half_table(cos.unsqueeze(unsqueeze_dim)), _half_table(sin.unsqueeze(unsqueeze_dim))
    _whole(q, 2 * c.shape[-1])
    return _rope(q, k, c, s, "interleave", -1, "pairs")


# GLM-4V, GLM-OCR: pairs on the first W lanes, full tables.
def _pairs_full_partial(q, k, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "interleave", c.shape[-1])


# Gemma-3n, Gemma-4, DiffusionGemma: one tensor.
def _half_single(x, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rope(_promoted(x, c, s), None, c, s)[0]


# NanoChat: the rotation by -angle.
def _half_negated(q, k, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), -sin.unsqueeze(unsqueeze_dim)
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s)


# DINOv3, EoMT-DINOv3, Sapiens-2: the leading prefix tokens (cls, registers) pass through.
def _half_after_prefix_tokens(q, k, cos, sin, **kwargs):
    num_prefix = q.shape[-2] - sin.shape[-2]
    if num_prefix < 0 or k.shape[-2] - sin.shape[-2] != num_prefix:
        raise ValueError("prefix token counts differ")
    q_rot, k_rot = _rope(_promoted(q[..., num_prefix:, :], cos, sin),
                         _promoted(k[..., num_prefix:, :], cos, sin), cos, sin)
    return (torch.cat((q[..., :num_prefix, :], q_rot), dim=-2),
            torch.cat((k[..., :num_prefix, :], k_rot), dim=-2))


# Perception Encoder (audio, video): 2x2 matrices from the tables' first half, rank-4 q and k.
def _pairs_from_stacked_freqs(q, k, cos, sin, unsqueeze_dim=1):
    if unsqueeze_dim < 0 or cos.dim() > 3:
        # The template sums axis 5 and flattens from axis 3: only rank-4 results of tables of
        # rank 3 or less (and an unsqueeze counted from the front) are the rotation.
        raise ValueError("negative unsqueeze_dim or tables of rank above 3")
    c, s = _half_table(cos).unsqueeze(unsqueeze_dim), _half_table(sin).unsqueeze(unsqueeze_dim)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q and k must have rank 4")
    _whole(q, 2 * c.shape[-1])
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "interleave", -1, "pairs")


# GPT-J, CodeGen: one rank-4 [B, S, H, D] tensor, tables [B, S, D/2], sin before cos.
def _pairs_gptj(tensor, sin, cos):
    if tensor.dim() != 4 or sin.dim() != 3 or cos.dim() != 3:
        raise ValueError("expected a rank-4 tensor and rank-3 tables")
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    _whole(tensor, 2 * c.shape[-1])
    return _rope(_promoted(tensor, c, s), None, c, s, "interleave", -1, "pairs")[0]


# gpt-oss: the half rotation, tables of D/2 columns.
def _half_halves_table(q, k, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    _whole(q, 2 * c.shape[-1])
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "half", -1, "halves")


# OpenAI privacy filter: the pair rotation, tables of D/2 columns.
def _pairs_pairs_table(q, k, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    _whole(q, 2 * c.shape[-1])
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "interleave", -1, "pairs")


# CLVP: q, k and v, tables gathered by position_ids.
def _half_qkv_gathered(q, k, v, cos, sin, position_ids, unsqueeze_dim=1):
    c = cos[position_ids].unsqueeze(unsqueeze_dim)
    s = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_out, k_out = _rope(_promoted(q, c, s), _promoted(k, c, s), c, s)
    return q_out, k_out, _rope(_promoted(v, c, s), None, c, s)[0]


# DeepSeek-V4: pairs on the trailing 2 * W lanes ([nope | rope] heads), fp32, x's dtype.
def _pairs_trailing(x, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rope_dim = 2 * c.shape[-1]
    if not 0 < rope_dim <= x.shape[-1]:
        raise ValueError("rope lanes outside the head")
    rotated = _rope(x[..., x.shape[-1] - rope_dim:], None, c, s, "interleave", -1, "pairs")[0]
    return torch.cat([x[..., : x.shape[-1] - rope_dim], rotated], dim=-1)


# MUSE-Glimmer assistant: q holds the last q_len positions of k's tables.
def _half_q_last_positions(q, k, cos, sin, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    q_len = q.size(-2)
    cq, sq = c[..., -q_len:, :], s[..., -q_len:, :]
    _whole(q, c.shape[-1])
    _whole(k, c.shape[-1])
    return (_rope(_promoted(q, cq, sq), None, cq, sq)[0],
            _rope(_promoted(k, c, s), None, c, s)[0])


# Qwen4-exp: partial rotary, k optional (q alone returned when k is None).
def _half_partial_k_optional(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    q_out, k_out = _rope(_promoted(q, c, s), None if k is None else _promoted(k, c, s), c, s,
                         "half", c.shape[-1])
    return q_out if k is None else (q_out, k_out)


# DeepSeek-V3 MLA and its kin (``apply_rotary_pos_emb_interleave``): pairs de-interleaved into
# halves (RoME's "interleave_half"), the tables' first half read per pair; k may be None.
def _interleave_half(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    c, s = _half_table(cos).unsqueeze(unsqueeze_dim), _half_table(sin).unsqueeze(unsqueeze_dim)
    _whole(q, 2 * c.shape[-1])
    return _rope(_promoted(q, c, s), None if k is None else _promoted(k, c, s), c, s,
                 "interleave_half", -1, "halves")


def _interleave_half_v5(q, k, cos, sin, unsqueeze_dim=1):
    return _interleave_half(q, k, cos, sin, None, unsqueeze_dim)


# Llama-4 and DeepSeek-V2 (``apply_rotary_emb``): q and k as (real, imag) pairs times complex
# freqs_cis in fp32, each result in its input's dtype: the interleave rotation with cos and sin
# the real and imaginary parts, read in place as "pairs" tables (lane 2i and 2i + 1 read column i).
def _complex_tables(xq, xk, freqs_cis):
    if freqs_cis.dtype != torch.complex64:  # complex128 math, or not complex: the original's
        raise ValueError("freqs_cis is not complex64")
    # flatten(3) keeps x's shape for rank 4 only; the originals reshape(-1) fails on no elements.
    if xk is None or xq.dim() != 4 or xk.dim() != 4 or xq.numel() == 0 or xk.numel() == 0:
        raise ValueError("not two non-empty rank-4 tensors")
    return freqs_cis.real, freqs_cis.imag


def _pairs_complex_llama4(xq, xk, freqs_cis):  # freqs_cis[:, :, None, :]
    cos, sin = _complex_tables(xq, xk, freqs_cis[:, :, None, :])
    return _rope(xq, xk, cos, sin, "interleave", -1, "pairs")


def _pairs_complex_deepseek_v2(xq, xk, freqs_cis):  # freqs_cis.unsqueeze(1)
    cos, sin = _complex_tables(xq, xk, freqs_cis.unsqueeze(1))
    return _rope(xq, xk, cos, sin, "interleave", -1, "pairs")


# The vision towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V and their kin
# (``apply_rotary_pos_emb_vision``): x [S, H, D] with tables [S, D] unsqueezed at -2, fp32 math,
# each result in its input's dtype.
def _needs_k(k):
    if k is None:  # the originals take k's attributes
        raise ValueError("k is None")


def _half_vision(q, k, cos, sin):
    _needs_k(k)
    return _rope(q, k, cos.unsqueeze(-2), sin.unsqueeze(-2))


def _pairs_vision(q, k, cos, sin):  # Inkling-2: the pair rotation
    _needs_k(k)
    if q.numel() == 0 or k.numel() == 0:  # its rotate_pairwise's view(-1) fails on no elements
        raise ValueError("empty q or k")
    return _rope(q, k, cos.unsqueeze(-2), sin.unsqueeze(-2), "interleave")


def _half_vision_partial(q, k, cos, sin):  # MiniMax-M3-VL: the first cos.shape[-1] lanes
    _needs_k(k)
    c, s = cos[:, None, :], sin[:, None, :]
    return _rope(_promoted(q, c, s), _promoted(k, c, s), c, s, "half", c.shape[-1])


# ------------------------------------------------------------------------------------------------
# The templates.

class Form(NamedTuple):
    name: str
    fast: Callable
    signature: Tuple[List[str], list, Optional[str]]
    templates: Tuple[str, ...]


_QK = (["q", "k", "cos", "sin", "unsqueeze_dim"], [1], None)
_X = (["x", "cos", "sin", "unsqueeze_dim"], [1], None)

_UNSQUEEZE = """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
"""
_HELIUM_TABLES = _UNSQUEEZE + """
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
"""
_LLAMA_TAIL = """
    q_embed = (q * cos) + ({rotate}(q) * sin)
    k_embed = (k * cos) + ({rotate}(k) * sin)
    return q_embed, k_embed
"""
_PARTIAL_TAIL = """
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + ({rotate}(q_rot) * sin)
    k_embed = (k_rot * cos) + ({rotate}(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
"""


def _llama(rotate: str) -> str:
    return ("def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):" + _UNSQUEEZE +
            _LLAMA_TAIL.format(rotate=rotate))


def _partial(rotate: str, tables: str = _UNSQUEEZE) -> str:
    return ("def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):" + tables +
            _PARTIAL_TAIL.format(rotate=rotate))


_FP32_AS_Q = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype{tables}
    q_embed = (q.float() * cos) + ({rotate}(q).float() * sin)
    k_embed = (k.float() * cos) + ({rotate}(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)
"""

FORMS: Tuple[Form, ...] = (
    Form("llama_each_own_dtype", _half_each_own_dtype, _QK, ("""
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (ROTATE_HALF(q) * sin)
    k_embed = (k * cos) + (ROTATE_HALF(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)
""",)),
    Form("half_fp32_as_q", _half_fp32_as_q, _QK, ("""
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (ROTATE_HALF(q.float()) * sin)
    k_embed = (k.float() * cos) + (ROTATE_HALF(k.float()) * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)
""", """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    origin_dtype = q.dtype
    q, k = q.float(), k.float()
    cos = cos.unsqueeze(unsqueeze_dim).float()
    sin = sin.unsqueeze(unsqueeze_dim).float()
    q_embed = (q * cos) + (ROTATE_HALF(q) * sin)
    k_embed = (k * cos) + (ROTATE_HALF(k) * sin)
    return q_embed.to(origin_dtype), k_embed.to(origin_dtype)
""")),
    Form("pairs_fp32_as_q", _pairs_fp32_as_q, _QK, ("""
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q = q.float()
    k = k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (ROTATE_PAIRS(q) * sin)
    k_embed = (k * cos) + (ROTATE_PAIRS(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)
""", _FP32_AS_Q.format(tables=_UNSQUEEZE.rstrip("\n"), rotate="ROTATE_PAIRS"))),
    Form("pairs_full", _pairs_full, _QK, (_llama("ROTATE_PAIRS"),)),
    Form("pairs_from_half_table_partial", _pairs_from_half_table_partial, _QK,
         (_partial("ROTATE_PAIRS", _HELIUM_TABLES),)),
    Form("pairs_from_half_table", _pairs_from_half_table, _QK, (
        "def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):" + _HELIUM_TABLES +
        _LLAMA_TAIL.format(rotate="ROTATE_PAIRS"),)),
    Form("pairs_from_half_table_fp32_as_q", _pairs_from_half_table_fp32_as_q, _QK,
         (_FP32_AS_Q.format(tables=_HELIUM_TABLES.rstrip("\n"), rotate="ROTATE_PAIRS"),)),
    Form("pairs_full_partial", _pairs_full_partial, _QK, (_partial("ROTATE_PAIRS"),)),
    Form("half_single", _half_single, _X, ("""
def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (x * cos) + (ROTATE_HALF(x) * sin)
""",)),
    Form("half_negated", _half_negated, _QK, (_llama("ROTATE_HALF_NEGATED"),)),
    Form("half_after_prefix_tokens", _half_after_prefix_tokens,
         (["q", "k", "cos", "sin"], [], "kwargs"), ("""
def apply_rotary_pos_emb(q, k, cos, sin, **kwargs):
    num_tokens = q.shape[-2]
    num_patches = sin.shape[-2]
    num_prefix_tokens = num_tokens - num_patches
    q_prefix_tokens, q_patches = q.split((num_prefix_tokens, num_patches), dim=-2)
    k_prefix_tokens, k_patches = k.split((num_prefix_tokens, num_patches), dim=-2)
    q_patches = (q_patches * cos) + (ROTATE_HALF(q_patches) * sin)
    k_patches = (k_patches * cos) + (ROTATE_HALF(k_patches) * sin)
    q = torch.cat((q_prefix_tokens, q_patches), dim=-2)
    k = torch.cat((k_prefix_tokens, k_patches), dim=-2)
    return q, k
""",)),
    Form("pairs_from_stacked_freqs", _pairs_from_stacked_freqs, _QK, ("""
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    freqs_cis = STACK_FREQS(cos, sin)
    freqs_cis = freqs_cis.unsqueeze(unsqueeze_dim)
    q_ = q.reshape(*q.shape[:-1], -1, 1, 2)
    k_ = k.reshape(*k.shape[:-1], -1, 1, 2)
    return (q_ * freqs_cis).sum(5).flatten(3), (k_ * freqs_cis).sum(5).flatten(3)
""",)),
    Form("pairs_gptj", _pairs_gptj, (["tensor", "sin", "cos"], [], None), ("""
def apply_rotary_pos_emb(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (ROTATE_EVERY_TWO_4D(tensor) * sin)
""",)),
    Form("half_halves_table", _half_halves_table, _QK,
         ("def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):" + _UNSQUEEZE + """
    q_embed = APPLY_HALVES(q, cos, sin)
    k_embed = APPLY_HALVES(k, cos, sin)
    return q_embed, k_embed
""",)),
    Form("pairs_pairs_table", _pairs_pairs_table, _QK,
         ("def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):" + _UNSQUEEZE + """
    q_embed = APPLY_PAIRS(q, cos, sin)
    k_embed = APPLY_PAIRS(k, cos, sin)
    return q_embed, k_embed
""",)),
    Form("half_qkv_gathered", _half_qkv_gathered,
         (["q", "k", "v", "cos", "sin", "position_ids", "unsqueeze_dim"], [1], None), ("""
def apply_rotary_pos_emb(q, k, v, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (ROTATE_HALF(q) * sin)
    k_embed = (k * cos) + (ROTATE_HALF(k) * sin)
    v_embed = (v * cos) + (ROTATE_HALF(v) * sin)
    return q_embed, k_embed, v_embed
""",)),
    Form("pairs_trailing", _pairs_trailing, _X, ("""
def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = ((rope.float() * cos) + (ROTATE_PAIRS(rope).float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
""",)),
    Form("half_q_last_positions", _half_q_last_positions, _QK, ("""
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_len = q.size(-2)
    q_embed = (q * cos[..., -q_len:, :]) + (ROTATE_HALF(q) * sin[..., -q_len:, :])
    k_embed = (k * cos) + (ROTATE_HALF(k) * sin)
    return q_embed, k_embed
""",)),
    Form("half_partial_k_optional", _half_partial_k_optional,
         (["q", "k", "cos", "sin", "unsqueeze_dim"], [None, None, None, 1], None), ("""
def apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rope, q_nope = q[..., :rotary_dim], q[..., rotary_dim:]
    q_rope = (q_rope * cos) + (ROTATE_HALF(q_rope) * sin)
    q_rotated = torch.cat([q_rope, q_nope], dim=-1)
    if k is not None:
        k_rope, k_nope = k[..., :rotary_dim], k[..., rotary_dim:]
        k_rope = (k_rope * cos) + (ROTATE_HALF(k_rope) * sin)
        k_rotated = torch.cat([k_rope, k_nope], dim=-1)
        return q_rotated, k_rotated
    else:
        return q_rotated
""",)),
)

FORM_BY_KEY: Dict[str, Form] = {key_of(src): form for form in FORMS for src in form.templates}

_MLA_TABLES = """
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
"""

# The MLA function, patched beside apply_rotary_pos_emb in the modules that define it.
INTERLEAVE_FORMS: Tuple[Form, ...] = (
    Form("interleave_half", _interleave_half,
         (["q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"], [None, 1], None), (
             "def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, "
             "unsqueeze_dim=1):" + _MLA_TABLES + """
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed
""",)),
    Form("interleave_half_k_optional", _interleave_half_v5, _QK, (
        "def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):" + _MLA_TABLES + """
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    if k is not None:
        k1, k2 = k[..., 0::2], k[..., 1::2]
        k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    else:
        k_embed = None
    return q_embed, k_embed
""",)),
)
INTERLEAVE_FORM_BY_KEY: Dict[str, Form] = {
    key_of(src): form for form in INTERLEAVE_FORMS for src in form.templates}

# The complex-frequency function (Llama-4, DeepSeek-V2), patched where a module defines it.
_XQ_XK = (["xq", "xk", "freqs_cis"], [], None)
COMPLEX_FORMS: Tuple[Form, ...] = (
    Form("pairs_complex_llama4", _pairs_complex_llama4, _XQ_XK, ("""
def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)
""",)),
    Form("pairs_complex_deepseek_v2", _pairs_complex_deepseek_v2, _XQ_XK, ("""
def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1).to(xq_.device)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)
    return xq_out, xk_out
""",)),
)
COMPLEX_FORM_BY_KEY: Dict[str, Form] = {
    key_of(src): form for form in COMPLEX_FORMS for src in form.templates}

# The vision towers' function, patched where a module defines it.
_QK_ONLY = (["q", "k", "cos", "sin"], [], None)
_VISION_FP32 = """
def apply_rotary_pos_emb_vision(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + ({rotate}(q) * sin)
    k_embed = (k * cos) + ({rotate}(k) * sin)
"""
VISION_FORMS: Tuple[Form, ...] = (
    Form("half_vision", _half_vision, _QK_ONLY, (_VISION_FP32.format(rotate="ROTATE_HALF") + """
    q_embed = q_embed.to(orig_q_dtype)
    k_embed = k_embed.to(orig_k_dtype)
    return q_embed, k_embed
""",)),
    Form("pairs_vision", _pairs_vision, _QK_ONLY, (_VISION_FP32.format(rotate="ROTATE_PAIRS") + """
    return q_embed.to(orig_q_dtype), k_embed.to(orig_k_dtype)
""",)),
    Form("half_vision_partial", _half_vision_partial, _QK_ONLY, ("""
def apply_rotary_pos_emb_vision(q, k, cos, sin):
    rot_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    q_rot, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k_rot, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_rot = q_rot * cos + ROTATE_HALF(q_rot) * sin
    k_rot = k_rot * cos + ROTATE_HALF(k_rot) * sin
    return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)
""",)),
)
VISION_FORM_BY_KEY: Dict[str, Form] = {
    key_of(src): form for form in VISION_FORMS for src in form.templates}


def make_replacement(form: Form, original: Callable) -> Callable:
    """`form.fast` with `original` (the module's own function) where RoME refuses the inputs."""
    fast = form.fast

    def replacement(*args, **kwargs):
        if not torch.compiler.is_compiling():
            try:
                return fast(*args, **kwargs)
            except _REFUSALS:
                pass
        return original(*args, **kwargs)

    replacement.__name__ = replacement.__qualname__ = function_def(form.templates[0]).name
    replacement.__doc__ = f"RoME's replacement for the '{form.name}' RoPE form (see " \
        f"rome._hf_forms.{fast.__name__})."
    replacement.rome_form = form.name
    return replacement
