"""f32 references of Mixture-of-Experts routing and the MoE FFN.

Dimension legend: ``T`` tokens, ``K`` hidden size, ``E`` routed experts, ``k`` experts per
token (``num_experts_per_tok``), ``G`` expert groups (``n_group``), ``N`` expert intermediate
size (``moe_intermediate_size``), ``Ns`` shared-expert intermediate size.

Sources: sparsely-gated MoE (Shazeer et al. 2017); Mixtral (Jiang et al. 2024,
arXiv:2401.04088); Qwen2-MoE / Qwen3-MoE; DeepSeekMoE with shared experts and
device-limited routing (DeepSeek-V2, arXiv:2405.04434 §2.2); auxiliary-loss-free balancing
with a per-expert correction bias (DeepSeek-V3, arXiv:2412.19437 §2.1.2). Every variant
follows transformers 5.x line by line — ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``,
``Qwen3MoeTopKRouter``, ``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter`` and their
``*SparseMoeBlock`` / ``*MoE`` modules — in f32:

- Mixtral: softmax scores, top-k, always renormalised.
- Qwen2-MoE, Qwen3-MoE: softmax scores, top-k, renormalised when ``norm_topk_prob``.
- DeepSeek-V2: softmax scores; top-k (``topk_method: greedy``) or top-k inside the
  ``topk_group`` best of ``n_group`` groups, a group scored by its max
  (``group_limited_greedy``); never renormalised; times ``routed_scaling_factor``.
- DeepSeek-V3 (``noaux_tc``): sigmoid scores ``s``; top-k of ``s + e_score_correction_bias``
  inside the ``topk_group`` best groups, a group scored by the sum of its top-2 biased
  scores; renormalised when ``norm_topk_prob``; times ``routed_scaling_factor``.

The combine weights are always the unbiased scores ``s`` gathered at the selected experts;
DeepSeek-V3's ``e_score_correction_bias`` only steers the choice. The router logits, the
scores and the bias stay f32: a bf16 add of a bias ~1e-3 to sigmoid scores flips choices.

Tie rule: among equal selection scores the lowest expert index wins, and among equal group
scores the lowest group index; the selected experts come out ordered by descending selection
score, ties by ascending index — a stable descending sort, the rule every backend's router
kernel must follow. ``torch.topk`` (which transformers uses) documents no rule for equal
values and follows none: on CPU (torch 2.13) eight all-zero scores with ``k = 2`` give
experts 6 and 5, and most tied inputs give a set other than the lowest indices. So
transformers is a reference for untied scores only; with real-valued f32 router logits exact
ties practically never occur, but low-precision or quantized logits can produce them.

Groups left out are masked with ``-inf`` before the final top-k (DeepSeek-V3). transformers'
DeepSeek-V2 masks them with ``0.0`` instead, which selects the same experts because every
softmax score in a kept group is ``> 0`` and :class:`RouterConfig` rejects a ``k`` larger
than the kept groups hold.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch

from zllm.capabilities.ops import OpDeclaration
from zllm.domain.activation import silu_mul
from zllm.domain.linear import linear
from zllm.weights.formats import ALL_FORMATS, QuantizedTensor

#: ``scoring_func`` values: how router logits become expert scores.
SCORING_FUNCS = ("softmax", "sigmoid")
#: ``topk_method`` values (DeepSeek's names): plain top-k, top-k inside the best groups by
#: their max score (DeepSeek-V2), or by the sum of their top-2 biased scores (DeepSeek-V3).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
#: HF ``model_type`` values :func:`router_config_from_hf` reads.
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")

# Added to the renormalisation denominator as DeepSeek-V3 does (transformers
# ``DeepseekV3TopkRouter``): it only guards an all-zero sum, and rounds away for any sum above
# ~1e-12, so softmax routers divide exactly as Mixtral and Qwen do.
_RENORM_EPS = 1e-20

# Rows up to which _topk_lowest_index checks for ties in Python: a decode step's few rows.
_TIE_CHECK_PYTHON_ROWS = 4


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} {value!r} is not an integer >= 1")
    return value


@attrs.frozen
class RouterConfig:
    """How one MoE layer routes tokens to experts; field names are DeepSeek's config keys.

    Attributes:
        num_experts: routed experts ``E``.
        num_experts_per_tok: experts per token ``k``, ``1 <= k <= E``.
        scoring_func: ``"softmax"`` or ``"sigmoid"`` over the router logits.
        topk_method: one of :data:`TOPK_METHODS`.
        n_group: expert groups ``G`` (``E % G == 0``); experts ``g*E/G .. (g+1)*E/G - 1`` form
            group ``g``. Used by the grouped methods only.
        topk_group: groups kept per token, ``1 <= topk_group <= G``.
        norm_topk_prob: divide the ``k`` combine weights by their sum.
        routed_scaling_factor: multiplies the combine weights (after renormalising).
        experts_key: the config key ``num_experts`` came from, for error messages
            (``num_local_experts`` in Mixtral, ``n_routed_experts`` in DeepSeek).

    Raises:
        ValueError: settings that contradict each other, naming the keys: ``k > E``,
            ``E`` not divisible into ``G`` groups, ``topk_group > G``, ``k`` more than the
            kept groups hold, groups of one expert under ``noaux_tc`` (it sums a group's
            top-2), an unknown ``scoring_func`` / ``topk_method``.
    """

    num_experts: int
    num_experts_per_tok: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    experts_key: str = attrs.field(default="num_experts", eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        n_experts = _positive_int(self.experts_key, self.num_experts)
        k = _positive_int("num_experts_per_tok", self.num_experts_per_tok)
        n_group = _positive_int("n_group", self.n_group)
        topk_group = _positive_int("topk_group", self.topk_group)
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func {self.scoring_func!r} is not supported "
                f"(supported: {', '.join(SCORING_FUNCS)})"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"topk_method {self.topk_method!r} is not supported "
                f"(supported: {', '.join(TOPK_METHODS)})"
            )
        if k > n_experts:
            raise ValueError(
                f"num_experts_per_tok {k} > {self.experts_key} {n_experts}: "
                "a token cannot pick more experts than exist"
            )
        if not (
            isinstance(self.routed_scaling_factor, (int, float))
            and math.isfinite(self.routed_scaling_factor)
            and self.routed_scaling_factor > 0
        ):
            raise ValueError(
                f"routed_scaling_factor {self.routed_scaling_factor!r} is not a finite number > 0"
            )
        if topk_group > n_group:
            raise ValueError(
                f"topk_group {topk_group} > n_group {n_group}: cannot keep more groups than exist"
            )
        if self.topk_method == "greedy":
            return
        if n_experts % n_group:
            raise ValueError(
                f"{self.experts_key} {n_experts} is not divisible into n_group {n_group} groups"
            )
        per_group = n_experts // n_group
        if k > topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok {k} > the {topk_group * per_group} experts that topk_group "
                f"{topk_group} groups of {per_group} hold"
            )
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(
                "topk_method 'noaux_tc' scores a group by its top-2 experts, "
                f"but n_group {n_group} leaves {per_group} expert per group"
            )


@attrs.frozen(eq=False)
class RouterOutput:
    """The experts each token goes to and their combine weights.

    Attributes:
        topk_ids: int64 ``[T, k]``, ordered by descending selection score (ties: lower id).
        topk_weights: f32 ``[T, k]``, the weight of each selected expert's output.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def _topk_lowest_index(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices int64 [T, k], their values [T, k])`` of the ``k`` largest ``values [T, n]``,
    ties lowest index first: the first ``k`` of a stable descending sort.

    ``torch.topk`` over ``k + 1`` values is that answer whenever each row's ``k + 1`` largest
    values are distinct (its order is then by value alone, and value ``k + 1`` is out); a
    decode step's router takes that path (one ``topk`` and a check, against a sort of all
    ``n``), and a row with a tie among them takes the sort. The check is a Python loop for a
    few rows (cheaper than a tensor op's dispatch) and one comparison of tensors for a prefill.
    """
    n = values.shape[-1]
    if k < n:
        top, ids = values.topk(k + 1, dim=-1)  # [T, k + 1], descending
        if (all(all(a > b for a, b in itertools.pairwise(row)) for row in top.tolist())
                if top.shape[0] <= _TIE_CHECK_PYTHON_ROWS else bool((top[:, :-1] > top[:, 1:]).all())):
            return ids[:, :k], top[:, :k]
    order = torch.sort(values, dim=-1, descending=True, stable=True)
    return order.indices[:, :k], order.values[:, :k]


def _mask_groups(choice: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """``choice [T, E]`` with the experts outside the ``topk_group`` best groups at ``-inf``."""
    t, n_experts = choice.shape
    per_group = n_experts // cfg.n_group
    grouped = choice.view(t, cfg.n_group, per_group)  # [T, G, E/G]
    if cfg.topk_method == "group_limited_greedy":
        group_scores = grouped.amax(dim=-1)  # [T, G]
    else:  # noaux_tc
        group_scores = grouped.topk(2, dim=-1).values.sum(
            dim=-1
        )  # [T, G]; values only, so ties do not matter
    kept = _topk_lowest_index(group_scores, cfg.topk_group)[0]  # [T, topk_group]
    keep = torch.zeros(t, cfg.n_group, dtype=torch.bool, device=choice.device).scatter_(
        1, kept, True
    )  # [T, G]
    return choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))  # [T, E]


def select_experts(
    router_logits: torch.Tensor,
    cfg: RouterConfig,
    e_score_correction_bias: torch.Tensor | None = None,
) -> RouterOutput:
    """Route each token from its router logits (see the module docstring for every variant).

    Args:
        router_logits: f32 ``[T, E]``, finite.
        cfg: the layer's routing settings.
        e_score_correction_bias: f32 ``[E]`` for ``topk_method == "noaux_tc"`` (DeepSeek-V3),
            added to the scores for the choice only; None for every other method.

    Returns:
        :class:`RouterOutput`: ``topk_ids`` int64 ``[T, k]``, ``topk_weights`` f32 ``[T, k]``.
    """
    assert router_logits.dim() == 2 and router_logits.dtype == torch.float32, (
        router_logits.shape,
        router_logits.dtype,
    )
    assert router_logits.shape[1] == cfg.num_experts, (router_logits.shape, cfg.num_experts)
    # A finite sum means finite logits (one reduction); an infinite one may be an overflow of
    # finite logits, which the elementwise check tells apart.
    assert math.isfinite(router_logits.sum()) or bool(torch.isfinite(router_logits).all()), (
        "router logits are not finite (a NaN or infinite weight in the checkpoint, or an overflow before the router)"
    )
    assert (e_score_correction_bias is not None) == (cfg.topk_method == "noaux_tc"), cfg.topk_method
    if cfg.scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1)  # [T, E]
    else:
        scores = router_logits.sigmoid()  # [T, E]
    choice = scores
    if e_score_correction_bias is not None:
        assert e_score_correction_bias.shape == (cfg.num_experts,), e_score_correction_bias.shape
        assert e_score_correction_bias.dtype == torch.float32, e_score_correction_bias.dtype
        choice = scores + e_score_correction_bias  # [T, E]
    if cfg.topk_method != "greedy":
        choice = _mask_groups(choice, cfg)
    topk_ids, chosen = _topk_lowest_index(choice, cfg.num_experts_per_tok)  # [T, k] each
    # [T, k], unbiased: the chosen values themselves unless a bias or a group mask changed them
    topk_weights = chosen if choice is scores else scores.gather(1, topk_ids)
    if cfg.norm_topk_prob:
        total = topk_weights.sum(dim=-1, keepdim=True)  # [T, 1]
        if cfg.scoring_func != "softmax":
            # Softmax top-k weights sum to at least 1 / E, where adding the epsilon rounds away
            # (half an f32 ulp of any sum >= 2^-40 exceeds it): skipped, the same bits.
            total = total + _RENORM_EPS
        topk_weights = topk_weights / total
    if cfg.routed_scaling_factor != 1.0:  # times 1.0 is exact: skipped
        topk_weights = topk_weights * cfg.routed_scaling_factor
    return RouterOutput(topk_ids, topk_weights)


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    cfg: RouterConfig,
    e_score_correction_bias: torch.Tensor | None = None,
) -> RouterOutput:
    """Router logits ``x @ gate_weight^T`` in f32, then :func:`select_experts`.

    ``x`` f32 ``[T, K]``; ``gate_weight`` ``[E, K]`` (HF ``mlp.gate.weight``, GGUF
    ``ffn_gate_inp``; any float dtype, upcast to f32 as transformers' DeepSeek routers do).
    """
    assert tuple(gate_weight.shape) == (cfg.num_experts, x.shape[1]), (
        gate_weight.shape,
        x.shape,
        cfg.num_experts,
    )
    return select_experts(linear(x, gate_weight.float(), None), cfg, e_score_correction_bias)


class ExpertStack(Protocol):
    """A stacked expert weight ``[E, N, K]`` whose ``[e]`` is expert ``e``'s ``[N, K]`` weight.

    A dense tensor is one; a quantized stack (GGUF ``ffn_*_exps``) provides the same by
    handing out one expert's rows as a 2-D weight :func:`~zllm.domain.linear.linear` takes,
    so the reference reads only the experts a batch selected.
    """

    @property
    def shape(self) -> Sequence[int]: ...

    def __getitem__(self, expert: int) -> torch.Tensor | QuantizedTensor: ...


def swiglu_ffn(
    x: torch.Tensor,
    gate_proj: torch.Tensor | QuantizedTensor,
    up_proj: torch.Tensor | QuantizedTensor,
    down_proj: torch.Tensor | QuantizedTensor,
) -> torch.Tensor:
    """``down_proj(silu(gate_proj x) * up_proj x)`` (Shazeer 2020; HF ``LlamaMLP``).

    ``x`` f32 ``[T, K]``; ``gate_proj``, ``up_proj`` ``[N, K]``; ``down_proj`` ``[K, N]``
    (dense or quantized) -> f32 ``[T, K]``.
    """
    return linear(
        silu_mul(linear(x, gate_proj, None), linear(x, up_proj, None)), down_proj, None
    )  # [T, K]


@attrs.frozen(eq=False)
class SharedExperts:
    """The always-on experts of a DeepSeek or Qwen2-MoE layer, one SwiGLU FFN of width ``Ns``.

    DeepSeek's ``n_shared_experts`` experts are stored fused as one FFN of width
    ``n_shared_experts * moe_intermediate_size`` (HF ``mlp.shared_experts``) and added as is.
    Qwen2-MoE's ``mlp.shared_expert`` is scaled per token by
    ``sigmoid(x @ shared_expert_gate^T)`` (HF ``Qwen2MoeSparseMoeBlock``).

    Attributes:
        gate_proj, up_proj: ``[Ns, K]``.
        down_proj: ``[K, Ns]``.
        shared_expert_gate: ``[1, K]`` (Qwen2-MoE) or None (DeepSeek: no gate).
    """

    gate_proj: torch.Tensor | QuantizedTensor
    up_proj: torch.Tensor | QuantizedTensor
    down_proj: torch.Tensor | QuantizedTensor
    shared_expert_gate: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output f32 ``[T, K]`` for ``x`` f32 ``[T, K]``."""
        y = swiglu_ffn(x, self.gate_proj, self.up_proj, self.down_proj)  # [T, K]
        if self.shared_expert_gate is None:
            return y
        assert tuple(self.shared_expert_gate.shape) == (1, x.shape[1]), (
            self.shared_expert_gate.shape
        )
        return (
            torch.sigmoid(linear(x, self.shared_expert_gate.float(), None)) * y
        )  # [T, 1] * [T, K]


def moe_ffn(
    x: torch.Tensor,
    routing: RouterOutput,
    gate_exps: ExpertStack,
    up_exps: ExpertStack,
    down_exps: ExpertStack,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's selected experts' SwiGLU FFNs, plus the shared experts.

    ``out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t]) + shared(x[t])``, each
    expert run once over the rows routed to it, experts in ascending index (transformers'
    ``*Experts.forward``; llama.cpp's ``mul_mat_id`` buckets rows the same way).

    Args:
        x: f32 ``[T, K]``.
        routing: from :func:`route`, ``[T, k]``.
        gate_exps, up_exps: ``[E, N, K]`` (HF ``experts.{e}.gate_proj`` / ``up_proj`` stacked,
            or the two halves of transformers 5's fused ``gate_up_proj [E, 2N, K]``; GGUF
            ``ffn_gate_exps`` / ``ffn_up_exps``).
        down_exps: ``[E, K, N]`` (HF ``experts.{e}.down_proj``; GGUF ``ffn_down_exps``).
        shared: the layer's shared experts, or None.

    Returns:
        f32 ``[T, K]``.
    """
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, hidden = x.shape
    ids, weights = routing.topk_ids, routing.topk_weights
    assert ids.dim() == 2 and ids.shape[0] == t and weights.shape == ids.shape, (
        ids.shape,
        weights.shape,
        x.shape,
    )
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32, (ids.dtype, weights.dtype)
    n_experts, n_inter, k_in = gate_exps.shape
    assert k_in == hidden and tuple(up_exps.shape) == (n_experts, n_inter, hidden), (
        gate_exps.shape,
        up_exps.shape,
    )
    assert tuple(down_exps.shape) == (n_experts, hidden, n_inter), (
        down_exps.shape,
        gate_exps.shape,
    )
    assert ids.numel() == 0 or (0 <= int(ids.min()) and int(ids.max()) < n_experts), (
        "expert id out of range",
        n_experts,
    )
    out = torch.zeros_like(x)  # [T, K]
    for expert in torch.unique(ids).tolist():
        rows, slots = torch.where(
            ids == expert
        )  # tokens routed to this expert, and where in their top-k
        y = swiglu_ffn(x[rows], gate_exps[expert], up_exps[expert], down_exps[expert])  # [n, K]
        out.index_add_(0, rows, y * weights[rows, slots, None])
    if shared is not None:
        out = out + shared(x)
    return out


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    router: RouterConfig,
    gate_exps: ExpertStack,
    up_exps: ExpertStack,
    down_exps: ExpertStack,
    correction_bias: torch.Tensor | None = None,
    shared: SharedExperts | None = None,
) -> torch.Tensor:
    """The ``moe`` op: :func:`select_experts` on the router logits, then :func:`moe_ffn`.

    Args:
        x: f32 ``[T, K]``.
        router_logits: f32 ``[T, E]``; the model computes them as ``linear(x, gate_inp)`` and
            keeps them f32 (the router's choice is sensitive to rounding).
        router: the layer's :class:`RouterConfig`.
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` (dense or a quantized
            stack; the op's variant is their format).
        correction_bias: f32 ``[E]`` for ``noaux_tc`` routers (DeepSeek-V3), else None.
        shared: the layer's shared experts, or None.

    Returns:
        f32 ``[T, K]``.
    """
    return moe_ffn(
        x,
        select_experts(router_logits, router, correction_bias),
        gate_exps,
        up_exps,
        down_exps,
        shared,
    )


def router_config_from_hf(cfg: dict[str, Any]) -> RouterConfig:
    """The routing settings of an HF config dict (``config.json``) of a MoE model type.

    Reads what transformers 5 reads for each ``model_type`` (keys absent from the file take
    the transformers config class default): Mixtral always renormalises; Qwen2-MoE and
    Qwen3-MoE read ``norm_topk_prob`` (default False; released Qwen3-MoE checkpoints set
    True); DeepSeek-V2 reads ``topk_method`` and never renormalises (transformers ignores
    its ``norm_topk_prob``); DeepSeek-V3 is sigmoid with ``noaux_tc`` — transformers does not
    save ``scoring_func``/``topk_method``, so a file that names other values is rejected
    rather than silently routed differently.

    Raises:
        ValueError: an unsupported ``model_type``, a missing or mistyped key, or
            contradictory settings (names the key; see :class:`RouterConfig`).
    """
    model_type = cfg.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} has no MoE router (supported: {', '.join(MOE_MODEL_TYPES)})"
        )

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{model_type} config needs {key!r}")
        return cfg[key]

    def flag(key: str, default: bool) -> bool:
        value = cfg.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{key} {value!r} is not true or false")
        return value

    def number(key: str, default: float) -> float:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} {value!r} is not a number")
        return float(value)

    if model_type == "mixtral":
        return RouterConfig(
            need("num_local_experts"),
            need("num_experts_per_tok"),
            norm_topk_prob=True,
            experts_key="num_local_experts",
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        # Released Qwen3-MoE files say num_experts; transformers 5 saves it as num_local_experts.
        key = (
            "num_local_experts"
            if cfg.get("num_experts") is None and "num_local_experts" in cfg
            else "num_experts"
        )
        return RouterConfig(
            need(key),
            need("num_experts_per_tok"),
            norm_topk_prob=flag("norm_topk_prob", False),
            experts_key=key,
        )
    common: dict[str, Any] = dict(
        experts_key="n_routed_experts",
        routed_scaling_factor=number(
            "routed_scaling_factor", 1.0 if model_type == "deepseek_v2" else 2.5
        ),
    )
    if model_type == "deepseek_v2":
        method = cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method {method!r} is not supported for deepseek_v2 "
                "(supported: greedy, group_limited_greedy)"
            )
        grouped = method == "group_limited_greedy"
        return RouterConfig(
            need("n_routed_experts"),
            need("num_experts_per_tok"),
            topk_method=method,
            # transformers writes null groups for greedy routers; the grouped method needs them
            n_group=need("n_group") if grouped else cfg.get("n_group") or 1,
            topk_group=need("topk_group") if grouped else cfg.get("topk_group") or 1,
            **common,
        )
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key, value) != value:
            raise ValueError(
                f"{key} {cfg[key]!r} is not supported for deepseek_v3 (supported: {value!r})"
            )
    return RouterConfig(
        need("n_routed_experts"),
        cfg.get("num_experts_per_tok", 8),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=cfg.get("n_group", 8),
        topk_group=cfg.get("topk_group", 4),
        norm_topk_prob=flag("norm_topk_prob", True),
        **common,
    )


def is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) of an HF MoE config has a MoE FFN, not a dense one.

    As transformers 5's decoder layers decide: Mixtral every layer; Qwen2-MoE / Qwen3-MoE
    when ``layer`` is not in ``mlp_only_layers``, ``num_experts > 0`` and
    ``(layer + 1) % decoder_sparse_step == 0``; DeepSeek-V2/V3 from
    ``layer >= first_k_dense_replace`` on (defaults 0 and 3; ``moe_layer_freq`` of the
    original DeepSeek code is not read by transformers and is 1 in released checkpoints).

    Raises:
        ValueError: an unsupported ``model_type`` or a mistyped key (names it).
    """
    model_type = cfg.get("model_type")
    assert layer >= 0, layer
    if model_type == "mixtral":
        return True
    if model_type in ("qwen2_moe", "qwen3_moe"):
        mlp_only = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise ValueError(f"mlp_only_layers {mlp_only!r} is not a list of layer indices")
        step = _positive_int("decoder_sparse_step", cfg.get("decoder_sparse_step", 1))
        n_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        return layer not in mlp_only and n_experts > 0 and (layer + 1) % step == 0
    if model_type in ("deepseek_v2", "deepseek_v3"):
        first_dense = cfg.get("first_k_dense_replace", 0 if model_type == "deepseek_v2" else 3)
        if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
            raise ValueError(f"first_k_dense_replace {first_dense!r} is not an integer >= 0")
        return layer >= first_dense
    raise ValueError(
        f"model_type {model_type!r} has no MoE layers (supported: {', '.join(MOE_MODEL_TYPES)})"
    )


OPS = (
    OpDeclaration(
        name="moe",
        variants=ALL_FORMATS,
        args=(
            "x",
            "router_logits",
            "router",
            "gate_exps",
            "up_exps",
            "down_exps",
            "correction_bias",
            "shared",
        ),
        weight_arg="gate_exps",
        optional_args=("correction_bias", "shared"),
        signature=(
            "(x f32 [T, K], router_logits f32 [T, E], router RouterConfig, gate_exps [E, N, K], "
            "up_exps [E, N, K], down_exps [E, K, N], correction_bias f32 [E] or None, "
            "shared SharedExperts or None) -> f32 [T, K] = sum over the k selected experts e of "
            "w[t, e] * down_e(silu(gate_e x[t]) * up_e x[t]) + shared(x[t]); experts chosen by "
            "select_experts (ties: lowest expert index); variant = format of the expert stacks"
        ),
        reference="zllm.domain.moe:moe",
        cases="zllm.conformance.cases:moe_cases",
    ),
)
