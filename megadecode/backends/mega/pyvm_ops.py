"""The opcode semantics of pyvm, the megakernel's golden model: one method per opcode, plain torch, fp32
activations, weights and caches in their dtype, keys and latents read back rounded to the cache dtype. `PyVM`
(pyvm.py) owns the arena, the counters, the schedule and the access records these methods go through
(`rf`/`wf` for floats, `ri`/`wi` for ints, `cache_row`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...quant.mxfp4 import MXFP4Tensor
from ...quant.mxfp4_frag import KREC, MXFP4Frag, restore
from ...reference.activations import situ_glu
from ...reference.rope import apply_rope
from .isa import (
    FRAG_TILE,
    F_FRAG,
    F_GREEDY,
    F_INTERLEAVED,
    F_MXFP4,
    F_NOPE,
    F_NORM,
    F_RENORM,
    F_RESID,
    F_SHARED,
    F_SIGMOID,
    F_SITU,
    F_STORE,
    F_TC,
    F_WRITE_NORMED,
    PASS,
    bits_f32,
    tc_input,
    up_chunks,
    up_passes,
)


def mix32(seed: torch.Tensor | int, b: int, v: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of (seed, sequence, vocabulary index) -> uint32 values in int64 (the Gumbel noise source)."""
    m = 0xFFFFFFFF
    x = (int(seed) * 0x9E3779B1 + b * 0x85EBCA77 + v.long() * 0xC2B2AE3D) & m
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def gumbel(seed: int, b: int, V: int, device) -> torch.Tensor:
    u = ((mix32(seed, b, torch.arange(V, device=device)) >> 8).float() + 0.5) / 16777216.0
    return -torch.log(-torch.log(u))


def rope(x: torch.Tensor, pos: int, inv: torch.Tensor, att: float, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., dim] (fp32) by position `pos`: cos/sin = cos/sin(pos * inv) * att."""
    freqs = float(pos) * inv.float()
    c, s = freqs.cos() * att, freqs.sin() * att
    d = x.shape[-1]
    return apply_rope(x.reshape(1, -1, d), c[None], s[None], interleaved).reshape(x.shape)


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w.float() if w is not None else y


class VMOps:
    """The opcodes, mixed into PyVM; each takes the instruction and its decoded arguments."""

    def op_nop(self, ins, a):
        pass

    def op_embed(self, ins, a):
        tok = self.ri(a["tok_off"], a["B"])
        W = self.T[a["w"]]
        for t in range(a["B"]):
            self.wf(a["out_off"] + t * a["D"] + a["c0"], W[int(tok[t]), a["c0"]:a["c1"]].float())

    def _rows_in(self, a) -> torch.Tensor:
        B, K = a["B"], a["K"]
        x = torch.stack([self.rf(a["x_off"] + t * a["x_stride"], K) for t in range(B)])
        if a.get("x2_off", -1) >= 0:  # the input is the sum of two buffers (kimi_k3: layer_in + attn_out)
            x = x + torch.stack([self.rf(a["x2_off"] + t * a["x_stride"], K) for t in range(B)])
        return x

    def _normed(self, ins, a) -> torch.Tensor:
        x = self._rows_in(a)
        if ins.flags & F_NORM:
            x = rms(x, self.T[a["norm_w"]], bits_f32(a["eps_bits"]))
        return x

    def _write_rows(self, a, y: torch.Tensor, resid: bool) -> None:
        n = y.shape[1]
        for t in range(a["B"]):
            col = t * a["out_stride"] + a["out_col"] + a["r0"]
            y_t = y[t]
            for add in ("add0_off", "add1_off"):  # addends laid out like the output
                if a.get(add, -1) >= 0:
                    y_t = y_t + self.rf(a[add] + col, n)
            if resid:
                y_t = self.rf(a["out_off"] + col, n) + y_t
            self.wf(a["out_off"] + col, y_t)

    def _rows_times(self, ins, a, w: torch.Tensor) -> torch.Tensor:
        """The instruction's input rows times the weight rows w (its [r0, r1) slice): in fp32 after the norm, or
        under F_TC as the tensor-core loop computes them, the input (times the norm weight) as bf16 pairs hi + lo
        (isa.tc_input), the rstd applied to the sums."""
        if not ins.flags & F_TC:
            return self._normed(ins, a) @ w.float().T
        x = self._rows_in(a)
        if not ins.flags & F_NORM:
            return tc_input(x) @ w.float().T
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + bits_f32(a["eps_bits"]))
        return (tc_input(x, self.T[a["norm_w"]]) @ w.float().T) * rstd

    def op_matvec(self, ins, a):
        W = self.T[a["w"]][a["r0"]:a["r1"]]
        self._write_rows(a, self._rows_times(ins, a, W), bool(ins.flags & F_RESID))
        if ins.flags & F_WRITE_NORMED and a["r0"] == 0:
            x = self._normed(ins, a)
            for t in range(a["B"]):
                self.wf(a["normed_off"] + t * a["K"], x[t])

    def op_glu(self, ins, a):
        g = self._rows_times(ins, a, self.T[a["wg"]][a["r0"]:a["r1"]])
        u = self._rows_times(ins, a, self.T[a["wu"]][a["r0"]:a["r1"]])
        self._write_rows(a, F.silu(g) * u, False)

    def op_attn_gqa(self, ins, a):
        b, h, s, S, H, KH, d = (a[k] for k in ("b", "h", "s", "S", "H", "KH", "d"))
        G = H // KH
        pos, slot = int(self.ri(a["pos_off"] + b, 1)), int(self.ri(a["slot_off"] + b, 1))
        eps, att = bits_f32(a["eps_bits"]), bits_f32(a["att_bits"])
        inv = self.T[a["rope_w"]]
        base = a["qkv_off"] + b * a["qkv_stride"]
        q = torch.stack([self.rf(base + (h * G + g) * d, d) for g in range(G)])
        q = rope(rms(q, self.T[a["qn_w"]], eps), pos, inv, att, False)
        L = pos + 1
        lo, hi = s * L // S, (s + 1) * L // S
        if s == S - 1:  # the split holding this token's position writes its key and value
            k = rope(rms(self.rf(base + (H + h) * d, d), self.T[a["kn_w"]], eps), pos, inv, att, False)
            self.cache_row(a["kc"], (slot, pos, h), write=k)
            self.cache_row(a["vc"], (slot, pos, h), write=self.rf(base + (H + KH + h) * d, d))
        dev = self.f32.device
        m = torch.full((G,), float("-inf"), device=dev)
        lsum, acc = torch.zeros(G, device=dev), torch.zeros(G, d, device=dev)
        if hi > lo:
            K = torch.stack([self.cache_row(a["kc"], (slot, p, h)).float() for p in range(lo, hi)])
            V = torch.stack([self.cache_row(a["vc"], (slot, p, h)).float() for p in range(lo, hi)])
            sc = (q @ K.T) * bits_f32(a["scale_bits"])  # [G, n]
            m = sc.max(-1).values
            pr = torch.exp(sc - m[:, None])
            lsum, acc = pr.sum(-1), pr @ V
        for g in range(G):
            self.wf(a["part_off"] + ((b * H + h * G + g) * S + s) * (d + 2),
                    torch.cat((m[g:g + 1], lsum[g:g + 1], acc[g])))

    def op_merge(self, ins, a):
        b, h, S, H, d = (a[k] for k in ("b", "h", "S", "H", "d"))
        parts = torch.stack([self.rf(a["part_off"] + ((b * H + h) * S + s) * (d + 2), d + 2) for s in range(S)])
        m, lsum, acc = parts[:, 0], parts[:, 1], parts[:, 2:]
        M = m.max()
        wgt = torch.where(torch.isfinite(m), torch.exp(m - M), torch.zeros_like(m))
        o = (wgt[:, None] * acc).sum(0) / (wgt * lsum).sum()
        if a["wuv"] >= 0:  # MLA: the head's value up-projection on the latent output
            P, dv = a["P"], a["dv"]
            W = self.T[a["wuv"]][h * (P + dv) + P:h * (P + dv) + P + dv].float()  # [V, C]
            o = W @ o
        if a["gate_off"] >= 0:  # kimi_k3's output gate, per (head, value) element
            o = o * torch.sigmoid(self.rf(a["gate_off"] + b * a["out_stride"] + h * a["dv"], a["dv"]))
        self.wf(a["out_off"] + b * a["out_stride"] + h * a["dv"], o)

    def op_route(self, ins, a):
        E, A, B = a["E"], a["A"], a["B"]
        logits = torch.stack([self.rf(a["logits_off"] + t * E, E) for t in range(B)])
        if ins.flags & F_SIGMOID:
            scores = torch.sigmoid(logits)
            choice = scores + (self.T[a["bias_w"]].float()[None] if a["bias_w"] >= 0 else 0)
            G = a["n_group"]
            if G > 1:
                grouped = choice.view(B, G, -1)
                gs = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
                keep = torch.zeros_like(gs, dtype=torch.bool)
                keep.scatter_(1, torch.sort(gs, dim=-1, descending=True, stable=True).indices[:, :a["topk_group"]],
                              True)
                choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(B, E)
            ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :A]
            w = scores.gather(1, ids)
            if ins.flags & F_RENORM:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * bits_f32(a["scale_bits"])
        else:
            probs = torch.softmax(logits, dim=-1)
            ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :A]
            w = probs.gather(1, ids)
            if ins.flags & F_RENORM:
                w = w / w.sum(-1, keepdim=True)
        self.wi(a["ids_off"], ids.flatten())
        self.wf(a["wts_off"], w.flatten())
        flat = ids.flatten().tolist()
        uniq = sorted(set(flat))
        pstart, ptok, pslot, pairof = [0], [], [], [0] * (B * A)
        for e in uniq:
            for j, x in enumerate(flat):
                if x == e:
                    pairof[j] = len(ptok)
                    ptok.append(j // A)
                    pslot.append(j % A)
            pstart.append(len(ptok))
        qst = [0]
        for u in range(len(uniq)):
            qst.append(qst[-1] + -(-(pstart[u + 1] - pstart[u]) // PASS))
        self.wi(a["nuniq_off"], [len(uniq)])
        self.wi(a["qst_off"], qst)
        self.wi(a["uniq_off"], uniq)
        self.wi(a["pstart_off"], pstart)
        self.wi(a["ptok_off"], ptok)
        self.wi(a["pslot_off"], pslot)
        self.wi(a["pairof_off"], pairof)

    def _groups(self, a):
        n = int(self.ri(a["nuniq_off"], 1))
        uniq = self.ri(a["uniq_off"], n).tolist()
        pstart = self.ri(a["pstart_off"], n + 1).tolist()
        return n, uniq, pstart

    def _rows_of(self, ins, w: int, s: int, e: int, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of expert e's weight (table entry w; MXFP4: packed w + scales s, decoded exactly; F_FRAG:
        the records under w, restored to the checkpoint's order first)."""
        if ins.flags & F_FRAG:
            rec = self.T[w][e:e + 1]
            f = MXFP4Frag(rec, torch.Size((1, rec.shape[1] * FRAG_TILE, rec.shape[2] * KREC)))
            return restore(f).dequantize(torch.float32)[0, r0:r1]
        if ins.flags & F_MXFP4:
            return MXFP4Tensor(self.T[w][e, r0:r1], self.T[s][e, r0:r1]).dequantize(torch.float32)
        return self.T[w][e, r0:r1].float()

    def op_expert_up(self, ins, a):
        I, D = a["I"], a["D"]
        n, uniq, pstart = self._groups(a)
        P, pre_arg = up_passes(ins.flags)  # pairs per pass and the pass prefix (MXFP4: one pair a pass)
        pre = self.ri(a[pre_arg], n + 1).tolist()
        unit = FRAG_TILE if ins.flags & F_FRAG else 1  # F_FRAG: shares of whole 16-row tiles
        for u, q, r0, r1 in up_chunks(pre, I, a["w"], a["W"], unit):
            p0 = pstart[u] + q * P
            pairs = range(p0, min(pstart[u + 1], p0 + P))
            toks = self.ri(a["ptok_off"] + p0, len(pairs)).tolist()
            x = torch.stack([self.rf(a["x_off"] + t * D, D) for t in toks])
            g = x @ self._rows_of(ins, a["gu"], a["gus"], uniq[u], r0, r1).T
            up = x @ self._rows_of(ins, a["gu"], a["gus"], uniq[u], I + r0, I + r1).T
            hv = situ_glu(g, up) if ins.flags & F_SITU else F.silu(g) * up
            for j, p in enumerate(pairs):
                self.wf(a["h_off"] + p * I + r0, hv[j])

    def op_expert_down(self, ins, a):
        I, D, r0, r1, B, A = (a[k] for k in ("I", "D", "r0", "r1", "B", "A"))
        n, uniq, pstart = self._groups(a)
        for u in range(n):
            Wd = self._rows_of(ins, a["dn"], a["dns"], uniq[u], r0, r1)  # [rows, I]
            for p in range(pstart[u], pstart[u + 1]):
                self.wf(a["y_off"] + p * D + r0, Wd @ self.rf(a["h_off"] + p * I, I))
        pairof = self.ri(a["pairof_off"], B * A).tolist()
        wts = self.rf(a["wts_off"], B * A)
        for t in range(B):
            out = torch.zeros(r1 - r0, device=wts.device) if ins.flags & F_STORE else \
                self.rf(a["out_off"] + t * D + r0, r1 - r0).clone()
            for k in range(A):
                out = out + wts[t * A + k] * self.rf(a["y_off"] + pairof[t * A + k] * D + r0, r1 - r0)
            if ins.flags & F_SHARED:
                out = out + self.rf(a["shared_off"] + t * D + r0, r1 - r0)
            self.wf(a["out_off"] + t * D + r0, out)

    def op_sample(self, ins, a):
        V, b = a["V"], a["b"]
        lg = self.rf(a["logits_off"] + b * V, V)
        if ins.flags & F_GREEDY:
            tok = int(torch.argmax(lg))
        else:
            seed = int(self.ri(a["seed_off"], 1))
            tok = int(torch.argmax(lg * bits_f32(a["inv_temp_bits"]) + gumbel(seed, b, V, lg.device)))
        self.wi(a["tok_out_off"] + b, [tok])
        self.wf(a["lp_out_off"] + b, (lg[tok] - torch.logsumexp(lg, 0)).reshape(1))

    def op_mla_kv(self, ins, a):
        C, R, b = a["C"], a["R"], a["b"]
        pos, slot = int(self.ri(a["pos_off"] + b, 1)), int(self.ri(a["slot_off"] + b, 1))
        kv = self.rf(a["kva_off"] + b * a["kva_stride"], C + R)
        lat = rms(kv[:C], self.T[a["norm_w"]], bits_f32(a["eps_bits"]))
        pe = kv[C:] if ins.flags & F_NOPE else rope(kv[C:], pos, self.T[a["rope_w"]], bits_f32(a["att_bits"]),
                                                      bool(ins.flags & F_INTERLEAVED))
        self.cache_row(a["cache"], (slot, pos), write=torch.cat((lat, pe)))

    def op_mla_q(self, ins, a):
        b, h, H, P, R, C, V = (a[k] for k in ("b", "h", "H", "P", "R", "C", "V"))
        pos = int(self.ri(a["pos_off"] + b, 1))
        q = self.rf(a["qb_off"] + b * a["qb_stride"] + h * (P + R), P + R)
        W = self.T[a["wkv"]][h * (P + V):h * (P + V) + P].float()  # [P, C]
        self.wf(a["qlat_off"] + (b * H + h) * C, q[:P] @ W)
        pe = q[P:] if ins.flags & F_NOPE else rope(q[P:], pos, self.T[a["rope_w"]], bits_f32(a["att_bits"]),
                                                     bool(ins.flags & F_INTERLEAVED))
        self.wf(a["qpe_off"] + (b * H + h) * R, pe)

    def op_mla_attn(self, ins, a):
        b, h0, HB, s, S, H, C, R = (a[k] for k in ("b", "h0", "HB", "s", "S", "H", "C", "R"))
        pos, slot = int(self.ri(a["pos_off"] + b, 1)), int(self.ri(a["slot_off"] + b, 1))
        L = pos + 1
        lo, hi = s * L // S, (s + 1) * L // S
        ql = torch.stack([self.rf(a["qlat_off"] + (b * H + h) * C, C) for h in range(h0, h0 + HB)])
        qp = torch.stack([self.rf(a["qpe_off"] + (b * H + h) * R, R) for h in range(h0, h0 + HB)])
        dev = self.f32.device
        m = torch.full((HB,), float("-inf"), device=dev)
        lsum, acc = torch.zeros(HB, device=dev), torch.zeros(HB, C, device=dev)
        if hi > lo:
            rows = torch.stack([self.cache_row(a["cache"], (slot, p)).float() for p in range(lo, hi)])
            sc = (ql @ rows[:, :C].T + qp @ rows[:, C:].T) * bits_f32(a["scale_bits"])
            m = sc.max(-1).values
            pr = torch.exp(sc - m[:, None])
            lsum, acc = pr.sum(-1), pr @ rows[:, :C]
        for j, h in enumerate(range(h0, h0 + HB)):
            self.wf(a["part_off"] + ((b * H + h) * S + s) * (C + 2), torch.cat((m[j:j + 1], lsum[j:j + 1], acc[j])))

    def op_attn_res(self, ins, a):
        B, D, b, c0, c1 = a["B"], a["D"], a["b"], a["c0"], a["c1"]
        src = torch.stack([self.rf(a["src_off"] + (s * B + b) * D, D) for s in range(a["nsrc"])])  # [S, D]
        keys = rms(src, self.T[a["norm_w"]], bits_f32(a["eps_bits"]))
        alpha = torch.softmax(keys @ self.T[a["query_w"]].float(), dim=0)
        self.wf(a["out_off"] + b * D + c0, alpha @ src[:, c0:c1])

    def op_kda_step(self, ins, a):
        b, h, H, K = a["b"], a["h"], a["H"], a["K"]
        HK = H * K
        slot = int(self.ri(a["slot_off"] + b, 1))
        conv_w = self.T[a["conv_w"]][:, 0, :].float()  # [3HK, W]
        ch = torch.cat([torch.arange(j * HK + h * K, j * HK + (h + 1) * K) for j in range(3)])  # q, k, v channels
        raw = torch.cat([self.rf(a["qkv_off"] + b * 3 * HK + j * HK + h * K, K) for j in range(3)])
        hist = torch.stack([self.cache_row(a["conv_state"], (slot, int(c))) for c in ch]).float()  # [3K, W-1]
        window = torch.cat((hist, raw[:, None]), -1)  # [3K, W], oldest first
        for j, c in enumerate(ch.tolist()):
            self.cache_row(a["conv_state"], (slot, c), write=window[j, 1:])
        mixed = F.silu((window * conv_w[ch.to(conv_w.device)]).sum(-1))
        q, k, v = mixed[:K], mixed[K:2 * K], mixed[2 * K:]
        q = q / torch.sqrt((q * q).sum() + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum() + 1e-6)
        f = self.rf(a["f_off"] + b * HK + h * K, K) + self.T[a["dt_bias"]][h * K:(h + 1) * K].float()
        g = -self.T[a["a_log"]].float().reshape(-1)[h].exp() * F.softplus(f, threshold=20.0)
        beta = torch.sigmoid(self.rf(a["beta_off"] + b * H + h, 1))
        S = self.cache_row(a["rec_state"], (slot, h)).float()  # [K, V]
        S = S * g.exp()[:, None]
        S = S + k[:, None] * ((v - k @ S) * beta)[None, :]
        self.cache_row(a["rec_state"], (slot, h), write=S)
        o = q @ S
        o = o * torch.rsqrt(o.pow(2).mean() + bits_f32(a["eps_bits"])) * self.T[a["onorm_w"]].float()
        o = o * torch.sigmoid(self.rf(a["gate_off"] + b * HK + h * K, K))
        self.wf(a["out_off"] + b * HK + h * K, o)
