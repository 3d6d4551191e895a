"""The weight table: every static tensor a model needs and its shape. Names are transformers 5's own (the
module paths of its model classes), so routed experts are stacked per layer (`mlp.experts.gate_up_proj`
[E, 2*I, D] with gate rows first, `mlp.experts.down_proj` [E, D, I]) and kimi_linear's KDA layers hold one
`conv1d` and a `forget_gate` module (`_kda`). How checkpoints spell them (per expert on the hub, Kimi's
`block_sparse_moe`, ...) is megadecode/layouts.py's business.
kimi_k3 (`_k3_layer_extras`, megadecode/k3.md): MXFP4 routed experts stay packed in memory as two uint8 stacks per
projection, `mlp.experts.gate_up_proj.weight_packed` [E, 2*I, R/2] + `.weight_scale` [E, 2*I, R/32] (and
`down_proj` [E, R, I/2] + [E, R, I/32]).
FP8 checkpoints (cfg.expert_quant "fp8", megadecode/quant/fp8.py): routed experts stay FP8 in memory,
`mlp.experts.gate_up_proj` float8_e4m3fn [E, 2*I, D] + `mlp.experts.gate_up_proj_scale_inv` fp32
[E, 2*I/bn, ceil(D/bk)] (transformers' FP8Experts names), likewise `down_proj`; every other weight is
dequantized at load and held in the model dtype.
Expert parallelism (megadecode/parallel): with a shard, every stacked expert tensor holds the rank's own experts
only, [E / world, ...] (experts shard.lo .. shard.hi - 1 of the model), and an untied lm_head the rank's rows
(parallel/vocab.py: [ceil(V / world), D], zero rows past the vocabulary); everything else is the whole tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .config import ModelConfig
from .parallel.experts import ExpertShard
from .parallel.vocab import VocabShard, shard_rows, split_lm_head
from .quant.fp8 import FP8, FP8_MAX, scale_shape


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    # "linear" (std 1/sqrt(fan_in)), "norm" (1 + noise), "embed", "bias" (N(0, 0.1): router selection bias,
    # KDA dt_bias), "a_log" (KDA decay rate log, N(-1, 0.3): per-token decays exp(-exp(A)*softplus(.)) ~ 0.5-0.8)
    # MXFP4 (uint8): "mxfp4_packed" (uniform random bytes = random e2m1 codes), "mxfp4_scale" (e8m0 bytes
    # 2**round(log2(1 / (2.93 sqrt(fan_in)))) or half that, at random per block: 2.93 is the RMS of a uniformly
    # random e2m1 code; dequantized std 0.8-1.2 / sqrt(fan_in) for tiny-k3 and K3's dims)
    init: str
    fp32: bool = False  # kept in fp32 whatever the model dtype (the router selection bias)
    # Routed experts stacked over experts: "experts_gate_up" / "experts_down" (None: any other tensor).
    stacked: str | None = None
    # Kept quantized whatever the model dtype, never cast: "mxfp4" (one half of an MXFP4 weight, uint8: name ends
    # in .weight_packed or .weight_scale), "fp8" (float8_e4m3fn values), "fp8_scale" (their fp32
    # weight_scale_inv, one per `block` of weights).
    quant: str | None = None
    block: tuple[int, int] | None = None  # "fp8_scale": the (rows, cols) of weights each scale covers


def _mlp(prefix: str, d: int, inter: int) -> list[ParamSpec]:
    return [ParamSpec(f"{prefix}.gate_proj.weight", (inter, d), "linear"),
            ParamSpec(f"{prefix}.up_proj.weight", (inter, d), "linear"),
            ParamSpec(f"{prefix}.down_proj.weight", (d, inter), "linear")]


def _kda(a: str, cfg: ModelConfig) -> list[ParamSpec]:
    """A KDA layer, named as transformers' KimiLinearDeltaAttention holds it (the forget gate in its own
    module; q/k/v convs stacked into one depthwise `conv1d` [3*H*K, 1, kernel], channels q then k then v)."""
    D, H, K = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    HK, f = H * K, f"{a}.forget_gate"
    return [ParamSpec(f"{a}.q_proj.weight", (HK, D), "linear"),
            ParamSpec(f"{a}.k_proj.weight", (HK, D), "linear"),
            ParamSpec(f"{a}.v_proj.weight", (HK, D), "linear"),
            ParamSpec(f"{a}.conv1d.weight", (3 * HK, 1, cfg.conv_kernel), "linear"),
            ParamSpec(f"{f}.f_a_proj.weight", (K, D), "linear"),
            ParamSpec(f"{f}.f_b_proj.weight", (HK, K), "linear"),
            ParamSpec(f"{f}.dt_bias", (HK,), "bias"),
            ParamSpec(f"{f}.A_log", (1, 1, H, 1), "a_log"),
            ParamSpec(f"{a}.b_proj.weight", (H, D), "linear"),
            ParamSpec(f"{a}.g_a_proj.weight", (K, D), "linear"),
            ParamSpec(f"{a}.g_b_proj.weight", (HK, K), "linear"),
            ParamSpec(f"{a}.o_norm.weight", (K,), "norm"),
            ParamSpec(f"{a}.o_proj.weight", (D, HK), "linear")]


def vocab_shard(cfg: ModelConfig, shard: ExpertShard | None) -> VocabShard | None:
    """The rank's rows of the lm_head under expert parallelism (parallel/vocab.py), None where it is held whole."""
    if shard is None or not split_lm_head(cfg, shard.world):
        return None
    return VocabShard(cfg.vocab_size, shard.world, shard.rank)


def _lm_head_rows(cfg: ModelConfig, shard: ExpertShard | None) -> int:
    v = vocab_shard(cfg, shard)
    return cfg.vocab_size if v is None else v.per_rank


def param_specs(cfg: ModelConfig, shard: ExpertShard | None = None) -> dict[str, ParamSpec]:
    """The weight table of `cfg`; with `shard`, stacked routed experts hold that rank's experts only, and an untied
    lm_head the rank's rows (`vocab_shard`, zero rows past the vocabulary)."""
    if shard is not None and shard.num_experts != cfg.num_experts:
        raise ValueError(f"the expert shard splits {shard.num_experts} experts; the model has {cfg.num_experts}")
    D, H = cfg.hidden_size, cfg.num_heads
    specs = [ParamSpec("model.embed_tokens.weight", (cfg.vocab_size, D), "embed"),
             ParamSpec("model.norm.weight", (D,), "norm")]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (_lm_head_rows(cfg, shard), D), "linear"))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        specs += [ParamSpec(f"{p}.input_layernorm.weight", (D,), "norm"),
                  ParamSpec(f"{p}.post_attention_layernorm.weight", (D,), "norm")]
        a = f"{p}.self_attn"
        if cfg.is_kda(i):
            specs += _kda(a, cfg)
        elif cfg.is_mla:
            qk = cfg.qk_head_dim
            if cfg.q_lora_rank is None:
                specs.append(ParamSpec(f"{a}.q_proj.weight", (H * qk, D), "linear"))
            else:
                specs += [ParamSpec(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, D), "linear"),
                          ParamSpec(f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,), "norm"),
                          ParamSpec(f"{a}.q_b_proj.weight", (H * qk, cfg.q_lora_rank), "linear")]
            specs += [
                ParamSpec(f"{a}.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D), "linear"),
                ParamSpec(f"{a}.kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norm"),
                ParamSpec(f"{a}.kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                          "linear"),
                ParamSpec(f"{a}.o_proj.weight", (D, H * cfg.v_head_dim), "linear")]
        else:
            hd, kv = cfg.head_dim, cfg.num_kv_heads
            specs += [ParamSpec(f"{a}.q_proj.weight", (H * hd, D), "linear"),
                      ParamSpec(f"{a}.k_proj.weight", (kv * hd, D), "linear"),
                      ParamSpec(f"{a}.v_proj.weight", (kv * hd, D), "linear"),
                      ParamSpec(f"{a}.o_proj.weight", (D, H * hd), "linear"),
                      ParamSpec(f"{a}.q_norm.weight", (hd,), "norm"),
                      ParamSpec(f"{a}.k_norm.weight", (hd,), "norm")]
        if cfg.family == "kimi_k3":
            specs += _k3_layer_extras(cfg, i)
        m = f"{p}.mlp"
        if not cfg.moe_layers[i]:
            specs += _mlp(m, D, cfg.intermediate_size)
            continue
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        El = E if shard is None else shard.per_rank  # experts held here (stacked tensors' first dim)
        if cfg.latent_size:
            specs += _latent_moe(m, cfg, El)
            continue
        specs.append(ParamSpec(f"{m}.gate.weight", (E, D), "linear"))
        fp8_block = cfg.weight_block if cfg.expert_quant == "fp8" else None
        specs += _experts(f"{m}.experts", (El, 2 * I, D), (El, D, I), fp8_block)
        if cfg.score_func == "sigmoid":
            specs.append(ParamSpec(f"{m}.gate.e_score_correction_bias", (E,), "bias", fp32=True))
        if cfg.n_shared_experts:
            specs += _mlp(f"{m}.shared_experts", D, cfg.shared_intermediate_size)
    if cfg.attn_res_block_size:
        specs += _attn_res("model.attn_res", D)
    return {s.name: s for s in specs}


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its MTP layer as one more decoder layer, index L = num_layers, made as DeepSeek-V3 makes layer L
    (a MoE layer from first_k_dense_replace on; transformers' default 3 where config.json leaves it out): the MTP
    layer's decoder tensors and plan ops are that layer's (mtp.py)."""
    if cfg.num_mtp_layers < 1:
        raise ValueError(f"a {cfg.family} model with no MTP layer (num_nextn_predict_layers 0) has no MTP config")
    L = cfg.num_layers
    first_dense = cfg.moe_layers.index(True) if any(cfg.moe_layers) else cfg.hf.get("first_k_dense_replace", 3)
    return replace(cfg, num_layers=L + 1, moe_layers=cfg.moe_layers + (L >= first_dense,), num_mtp_layers=0)


def mtp_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The tensors of the model's MTP layer (DeepSeek-V3's layout under model.layers.{L}, L = num_layers), empty
    when it has none: `enorm`, `hnorm` [D] (the norms of the next token's embedding and of the hidden state),
    `eh_proj` [D, 2D] (over the two concatenated in that order), the decoder layer's tensors (`mtp_config`), and
    `shared_head.norm` [D] and `shared_head.head` [V, D] (a checkpoint may leave the head out: the model's lm_head
    then). The embedding is the model's (a checkpoint's `model.layers.{L}.embed_tokens` is a copy of it). Only the
    first MTP layer: the MTP drafter runs one."""
    if cfg.num_mtp_layers < 1:
        return {}
    D, p = cfg.hidden_size, f"model.layers.{cfg.num_layers}"
    specs = [ParamSpec(f"{p}.enorm.weight", (D,), "norm"), ParamSpec(f"{p}.hnorm.weight", (D,), "norm"),
             ParamSpec(f"{p}.eh_proj.weight", (D, 2 * D), "linear")]
    specs += [s for n, s in param_specs(mtp_config(cfg)).items() if n.startswith(p + ".")]
    specs += [ParamSpec(f"{p}.shared_head.norm.weight", (D,), "norm"),
              ParamSpec(f"{p}.shared_head.head.weight", (cfg.vocab_size, D), "linear")]
    return {s.name: s for s in specs}


def mtp_generator(seed: int, device="cpu") -> torch.Generator:
    """The random stream of the MTP layer's tensors: a stream of its own (seed + 2**32, never a model's seed: those
    are below 2**32), so the model's weights are the same with or without them."""
    return torch.Generator(device=device).manual_seed(seed + 2**32)


def _experts(prefix: str, gate_up: tuple, down: tuple, fp8_block: tuple[int, int] | None) -> list[ParamSpec]:
    """Stacked routed experts: float, or FP8 values + their block scales (module doc)."""
    out = []
    for name, shape, stacked in (("gate_up_proj", gate_up, "experts_gate_up"), ("down_proj", down, "experts_down")):
        if fp8_block is None:
            out.append(ParamSpec(f"{prefix}.{name}", shape, "linear", stacked=stacked))
        else:
            out += [ParamSpec(f"{prefix}.{name}", shape, "fp8", stacked=stacked, quant="fp8"),
                    ParamSpec(f"{prefix}.{name}_scale_inv", scale_shape(shape, fp8_block), "fp8_scale", fp32=True,
                              stacked=stacked, quant="fp8_scale", block=fp8_block)]
    return out


def _attn_res(prefix: str, d: int) -> list[ParamSpec]:
    """Block Attention Residuals: one pseudo-query and one key RMSNorm per layer (and one for the output)."""
    return [ParamSpec(f"{prefix}.query", (d,), "linear"), ParamSpec(f"{prefix}.norm.weight", (d,), "norm")]


def _k3_layer_extras(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """kimi_k3 per-layer tensors beyond kimi_linear's: AttnRes, the MLA output gate [H*V, D]."""
    specs = _attn_res(f"model.layers.{i}.attn_res", cfg.hidden_size) if cfg.attn_res_block_size else []
    if cfg.mla_output_gate and not cfg.is_kda(i):
        specs.append(ParamSpec(f"model.layers.{i}.self_attn.gate_proj.weight",
                               (cfg.num_heads * cfg.v_head_dim, cfg.hidden_size), "linear"))
    return specs


def _mxfp4(name: str, e: int, out: int, k: int, stacked: str) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.weight_packed", (e, out, k // 2), "mxfp4_packed", stacked=stacked, quant="mxfp4"),
            ParamSpec(f"{name}.weight_scale", (e, out, k // 32), "mxfp4_scale", stacked=stacked, quant="mxfp4")]


def _latent_moe(m: str, cfg: ModelConfig, held: int) -> list[ParamSpec]:
    """Stable LatentMoE (reference/latent_moe.py; its router.weight / router.bias are our gate.weight /
    gate.e_score_correction_bias, kimi_linear's names). Routed experts MXFP4 along their input dim; `held` of
    them in the stacks (all, or a rank's shard)."""
    D, E, I, R = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.latent_size
    return ([ParamSpec(f"{m}.gate.weight", (E, D), "linear"),
             ParamSpec(f"{m}.gate.e_score_correction_bias", (E,), "bias", fp32=True),
             ParamSpec(f"{m}.latent_down.weight", (R, D), "linear")]
            + _mxfp4(f"{m}.experts.gate_up_proj", held, 2 * I, R, "experts_gate_up")
            + _mxfp4(f"{m}.experts.down_proj", held, R, I, "experts_down")
            + [ParamSpec(f"{m}.latent_norm.weight", (R,), "norm"),
               ParamSpec(f"{m}.latent_up.weight", (D, R), "linear")]
            + _mlp(f"{m}.shared_experts", D, cfg.shared_intermediate_size))


def random_tensor(spec: ParamSpec, gen: torch.Generator, device, dtype: torch.dtype) -> torch.Tensor:
    """Random weights with O(1) activations, so that logits and routing decisions have clear margins."""
    if spec.quant == "mxfp4":
        return _random_mxfp4(spec, gen, device)
    if spec.init in ("fp8", "fp8_scale"):
        return _random_fp8(spec, gen, device)
    dt = torch.float32 if spec.fp32 else dtype
    t = torch.empty(spec.shape, device=device, dtype=dt)
    if spec.init == "linear":
        t.normal_(0.0, 1.0 / math.sqrt(spec.shape[-1]), generator=gen)
    elif spec.init == "norm":
        t.normal_(1.0, 0.1, generator=gen)
    elif spec.init == "embed":
        t.normal_(0.0, 1.0, generator=gen)
    elif spec.init == "bias":
        # Non-zero selection bias of the size of the sigmoid scores' spread: it changes which experts win.
        t.normal_(0.0, 0.1, generator=gen)
    elif spec.init == "a_log":
        t.normal_(-1.0, 0.3, generator=gen)
    else:
        raise ValueError(spec.init)
    return t


_E2M1_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)  # 2.93


def _random_mxfp4(spec: ParamSpec, gen: torch.Generator, device) -> torch.Tensor:
    if spec.init == "mxfp4_packed":
        return torch.randint(0, 256, spec.shape, generator=gen, device=device, dtype=torch.uint8)
    if spec.init != "mxfp4_scale":
        raise ValueError(spec.init)
    fan_in = spec.shape[-1] * 32
    b = 127 + round(math.log2(1.0 / (_E2M1_RMS * math.sqrt(fan_in))))  # dequantized std ~ 1/sqrt(fan_in)
    return torch.randint(b - 1, b + 1, spec.shape, generator=gen, device=device, dtype=torch.uint8)


FP8_CODE_STD = 112.0  # random FP8 codes: N(0, 112^2), clipped at 4 sigma (448, e4m3's largest finite value)


def _random_fp8(spec: ParamSpec, gen: torch.Generator, device) -> torch.Tensor:
    t = torch.empty(spec.shape, device=device, dtype=torch.float32)
    if spec.init == "fp8":
        return t.normal_(0.0, FP8_CODE_STD, generator=gen).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    if spec.init != "fp8_scale":
        raise ValueError(spec.init)
    fan_in = spec.shape[-1] * spec.block[1]
    return t.normal_(0.0, 0.1, generator=gen).exp_().mul_(1.0 / (FP8_CODE_STD * math.sqrt(fan_in)))


def random_experts(spec: ParamSpec, gen: torch.Generator, device, dtype: torch.dtype, lo: int = 0,
                   hi: int | None = None) -> torch.Tensor:
    """Experts lo .. hi - 1 of the stacked expert tensor `spec` ([E, ...]), drawn expert by expert from `gen`:
    every expert of the stack is drawn in order (the stream must pass the others' values), those outside
    [lo, hi) into a one-expert temporary that is dropped, so no more than the kept experts and one more are ever
    held. A rank of expert parallelism thus holds exactly the values the single-process model holds for its
    experts. On the CPU the values equal drawing the whole stack at once when an expert holds a multiple of 16
    values (torch's CPU normal_ transforms uniform draws 16 at a time; randint draws one per value in order),
    which every preset's routed experts do; not on CUDA (Philox offsets advance per launch)."""
    hi = spec.shape[0] if hi is None else hi
    one = replace(spec, shape=spec.shape[1:])
    out = None
    for e in range(spec.shape[0]):
        t = random_tensor(one, gen, device, dtype)
        if lo <= e < hi:
            if out is None:
                out = torch.empty((hi - lo, *t.shape), dtype=t.dtype, device=t.device)
            out[e - lo] = t
    return out


def random_weights(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0,
                   shard: ExpertShard | None = None, progress=None, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Random weights built directly on `device` (benchmarks build 60 GB models this way, on the GPU). Stacked
    routed experts are drawn expert by expert (`random_experts`); with `shard`, only the rank's own experts are
    kept, with the values the whole model holds for them, and of an untied lm_head the rank's rows. `progress`:
    called after each tensor as progress(bytes, total bytes) (`WeightProgress`). `mtp`: the MTP layer's tensors
    too (`mtp_specs`, none without an MTP layer), from their own stream (`mtp_generator`)."""
    if mtp and shard is not None:
        raise ValueError("the MTP layer's weights are built for one process (no expert parallelism)")
    gen = torch.Generator(device=device).manual_seed(seed)
    lo, hi = (0, None) if shard is None else (shard.lo, shard.hi)
    tick = WeightProgress(cfg, dtype, shard, progress)
    out = {}
    for name, s in param_specs(cfg).items():
        out[name] = random_experts(s, gen, device, dtype, lo, hi) if s.stacked else random_tensor(s, gen, device, dtype)
        tick(name)
    v = vocab_shard(cfg, shard)
    if v is not None:  # drawn whole (the stream passes every row), the rank's rows kept
        out["lm_head.weight"] = shard_rows(out["lm_head.weight"], v)
    if mtp:
        gen = mtp_generator(seed, device)
        for name, s in mtp_specs(cfg).items():
            out[name] = random_experts(s, gen, device, dtype) if s.stacked else random_tensor(s, gen, device, dtype)
    return out


def spec_bytes(s: ParamSpec, dtype_bytes: int) -> int:
    """Bytes of one weight as held (weight_bytes' count: quantized weights at their stored byte per value)."""
    return math.prod(s.shape) * (1 if s.quant in ("mxfp4", "fp8") else 4 if s.fp32 else dtype_bytes)


class WeightProgress:
    """Reports a weight build or load to `progress(bytes, total bytes)` as each tensor is done, in weight_bytes'
    bytes of the rank's share (the total: weight_bytes' `total`); a no-op without `progress`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, shard: ExpertShard | None, progress):
        self.progress = progress
        if progress is not None:
            nb = torch.empty((), dtype=dtype).element_size()
            self.sizes = {n: spec_bytes(s, nb) for n, s in param_specs(cfg, shard).items()}
            self.total = sum(self.sizes.values())

    def __call__(self, name: str) -> None:
        if self.progress is not None:
            self.progress(self.sizes.get(name, 0), self.total)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int, shard: ExpertShard | None = None) -> dict[str, int]:
    """Bytes of weights by role: `trunk` (everything read every step except experts and lm_head),
    `expert` (one routed expert of one layer; MXFP4 experts count their packed bytes + scales, 4.25 bits per
    weight; FP8 experts 1 byte per weight + their fp32 block scales), `lm_head`, and `total` (every weight held in
    memory, the embedding table included; with `shard`, a rank's: its own experts and lm_head rows only)."""
    trunk = lm = total = 0
    expert_by_layer: dict[str, int] = {}
    for s in param_specs(cfg, shard).values():
        n = spec_bytes(s, dtype_bytes)
        total += n
        if s.stacked:
            layer = s.name.split(".mlp.")[0]
            expert_by_layer[layer] = expert_by_layer.get(layer, 0) + n // s.shape[0]
            continue
        if s.name in ("lm_head.weight",) or (cfg.tie_word_embeddings and s.name == "model.embed_tokens.weight"):
            lm += n
        elif s.name == "model.embed_tokens.weight":
            continue  # an embedding row per token, not the table
        else:
            trunk += n
    expert = (next(iter(expert_by_layer.values())) if expert_by_layer
              else 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes)
    return {"trunk": trunk, "expert": expert, "lm_head": lm, "total": total}
