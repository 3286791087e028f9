"""The LM head and what is computed from its logits: fp32 logits from the compute dtype's operands
(FP32Head: bf16 products are exact in fp32, and a logit rounded to bf16 moves a log-prob by ~0.1
between two batch layouts), and each token's log-prob and entropy chunk by chunk of tokens, never a
(tokens x V) tensor: from logits a script already has (logprobs_from_logits, entropy_from_logits), or
fused into the head itself (FP32Head.request: its matmul, log-softmax and gather in one chunked pass,
the backward recomputing each chunk), which common.response_logprobs asks of a model's forward.
"""
from contextlib import nullcontext

import torch

class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(x)[y] chunk by chunk, with a hand-written backward into one gradient buffer:
    d/dx_j log softmax(x)[y] = 1[j = y] - softmax(x)_j needs only the saved logits, so no (N, V)
    log_softmax is stored and no full-size zero gradient allocated per chunk (as slicing would)."""

    @staticmethod
    def forward(ctx, logits, labels, rows):  # (N, V), (N,)
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for i in range(0, logits.shape[0], rows):
            chunk = torch.log_softmax(logits[i:i + rows].float(), dim=-1)
            out[i:i + rows] = chunk.gather(-1, labels[i:i + rows, None]).squeeze(-1)
        ctx.save_for_backward(logits, labels)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ctx.rows):
            g = grad_out[i:i + ctx.rows, None].float()
            chunk = torch.softmax(logits[i:i + ctx.rows].float(), dim=-1).mul_(-g)  # -softmax * g
            grad[i:i + ctx.rows] = chunk.scatter_add_(-1, labels[i:i + ctx.rows, None], g)
        return grad, None, None


EVAL_LOGITS = 2**28  # fp32 logits an evaluation forward may make (1 GiB): 2 rows at R = 1024, V = 128k


def on_gpu(t):
    """Kernels chosen by device (tests/memory_trace.py makes fake CPU tensors take a GPU's)."""
    return t.device.type != "cpu"


CHUNK_LOGITS = {"cpu": 2**22, "gpu": 2**26}  # fp32 logits a chunk holds: a CPU's allocator reuses them; a GPU's kernels want more


def chunk_rows(logits, chunk_elems, V=None):
    """Rows per chunk of ~chunk_elems logits (None: CHUNK_LOGITS) of V entries (default: logits' last dimension)."""
    if chunk_elems is None:
        chunk_elems = CHUNK_LOGITS["gpu" if on_gpu(logits) else "cpu"]
    return max(1, chunk_elems // (V or logits.shape[-1]))


def logprobs_from_logits(logits, labels, chunk_elems=None):
    """log softmax(logits)[label] per position, (...) from (..., V), in fp32: on a CPU chunk by chunk;
    on a GPU, where EVAL_LOGITS allow, log_softmax + gather (chunks: 0.83x, 0.50x with backward, H100)."""
    if chunk_elems is None and on_gpu(logits) and logits.numel() <= EVAL_LOGITS:
        return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    V = logits.shape[-1]
    out = _SelectiveLogSoftmax.apply(logits.reshape(-1, V), labels.reshape(-1), chunk_rows(logits, chunk_elems))
    return out.view(labels.shape)


def entropy_from_logits(logits, chunk_elems=None):
    """Entropy of softmax(logits) per position, (...) from (..., V), chunked like above."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = chunk_rows(logits, chunk_elems)
    out = []
    for i in range(0, flat.shape[0], rows):
        chunk = flat[i:i + rows].float()
        logp = chunk - torch.logsumexp(chunk, dim=-1, keepdim=True)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).view(logits.shape[:-1])




def _head_dtype(x, w):
    """The head's operand dtype: bf16 where its weight is (FSDP2's bf16 parameters, the sampler's
    copies) or bf16 autocast is on, as autocast would cast a linear's operands; else fp32."""
    kind = x.device.type
    cast = kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16
    return torch.bfloat16 if w.dtype == torch.bfloat16 or cast else torch.float32


def _mm32(a, b):
    """a @ b in fp32 from operands of one dtype: on a GPU one matmul with an fp32 result (bf16 products
    are exact in fp32), on a CPU, whose matmuls take one dtype, in fp32."""
    if on_gpu(a) and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _addmm32_(acc, a, b):
    """acc += a @ b in place, fp32 acc, operands of one dtype (_mm32's): no second acc-sized product."""
    if on_gpu(a) and a.dtype != torch.float32:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.float(), b.float())


def _head_mm(x, w, bias=None):
    """(N, H) x (V, H) -> (N, V) logits in fp32; in fp32 torch.nn.Linear's own op (F.linear), so that
    the fused head's logits are a plain head's to the bit."""
    if on_gpu(x) and x.dtype != torch.float32:
        out = torch.mm(x, w.t(), out_dtype=torch.float32)
        return out if bias is None else out + bias.float()
    return torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())


class _HeadMatmul(torch.autograd.Function):
    """x @ w.T in fp32 from bf16 x and w, no fp32 copy of a V x H weight per forward (per decoded
    token). The gradients are bf16 matmuls, as under autocast."""

    @staticmethod
    def forward(ctx, x, w):  # (..., H), (V, H)
        ctx.save_for_backward(x, w)
        return _head_mm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])  # (..., V)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.reshape(-1, g.shape[-1]).to(w.dtype)  # (N, V)
        return (g @ w).view(x.shape), g.t() @ x.reshape(-1, x.shape[-1])


class _HeadLogprobs(torch.autograd.Function):
    """log softmax(z)[label] per token, z = (x W^T + b) / temperature in fp32 from operands in `dtype`
    (the tokens a sampler's rule drops at -inf: `truncate`), and optionally the entropy of softmax(z)
    before truncation, chunk by chunk of `rows` tokens: no (tokens x V) tensor is ever held (for V =
    151,936 at 16K response tokens the fp32 logits alone are 10 GB); the backward recomputes each
    chunk's logits (one more head matmul, as Cut Cross-Entropy, arXiv:2411.09009). The gradient by
    hand: d logp_y / dz = 1[y] - softmax(z) over the kept tokens; d H / dz = -p (log p + H). W's
    gradient is accumulated in fp32 and returned in W's own dtype (an fp32 master's under autocast)."""

    @staticmethod
    def forward(ctx, x, w, bias, labels, dtype, temperature, truncate, entropy, entropy_grad, rows):  # (N, H), (V, H), (N,)
        xc, wc = x.to(dtype), w.to(dtype)
        logps, ents = [], []
        for i in range(0, x.shape[0], rows):
            z = _head_mm(xc[i:i + rows], wc, bias)  # (n, V)
            z = z if temperature == 1.0 else z / temperature
            if entropy:  # entropy_from_logits' and logprobs_from_logits' ops: a plain head's numbers to the bit
                lp = z - torch.logsumexp(z, dim=-1, keepdim=True)
                ents.append(-(lp.exp() * lp).sum(-1))
                del lp
            y = labels[i:i + rows]
            zt = z if truncate is None else truncate(z, y)
            logps.append(torch.log_softmax(zt, dim=-1).gather(-1, y[:, None]).squeeze(-1))
        ctx.save_for_backward(xc, w, bias, labels)
        ctx.knobs = dtype, x.dtype, temperature, truncate, entropy and entropy_grad, rows
        logp, ent = (torch.cat(t) if len(t) > 1 else t[0] if t else None for t in (logps, ents))
        if entropy and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        xc, w, bias, labels = ctx.saved_tensors
        dtype, x_dtype, temperature, truncate, entropy_grad, rows = ctx.knobs
        wc = w.to(dtype)
        gx, gw, gb = [], None, None
        for i in range(0, xc.shape[0], rows):
            z = _head_mm(xc[i:i + rows], wc, bias)
            z = z if temperature == 1.0 else z / temperature
            y = labels[i:i + rows, None]
            g = torch.zeros_like(y, dtype=torch.float32) if g_logp is None else g_logp[i:i + rows, None].float()
            zt = z if truncate is None else truncate(z, y[:, 0])
            gz = torch.softmax(zt, -1).mul_(-g).scatter_add_(-1, y, g)  # (n, V): d loss / d z
            if entropy_grad and g_ent is not None:
                lp = torch.log_softmax(z, -1)
                h = -(lp.exp() * lp).sum(-1, keepdim=True)
                gz -= g_ent[i:i + rows, None].float() * lp.exp() * (lp + h)
            gz = (gz if temperature == 1.0 else gz / temperature).to(dtype)
            if ctx.needs_input_grad[0]:
                gx.append(_mm32(gz, wc).to(x_dtype))  # (n, H)
            if ctx.needs_input_grad[1]:  # (V, H), fp32; a frozen head (LoRA's) makes none
                gw = _mm32(gz.t(), xc[i:i + rows]) if gw is None else _addmm32_(gw, gz.t(), xc[i:i + rows])
            if bias is not None and ctx.needs_input_grad[2]:
                gb = gz.float().sum(0) if gb is None else gb.add_(gz.float().sum(0))
        gx = None if not gx else torch.cat(gx) if len(gx) > 1 else gx[0]
        return (gx, None if gw is None else gw.to(w.dtype), None if gb is None else gb.to(bias.dtype), *[None] * 7)


class FP32Head(torch.nn.Linear):
    """An LM head whose logits are fp32: from bf16 operands where the model computes in bf16 (fp32
    accumulation: a logit of GPT-2's size, 30-120, would have steps of 0.25-0.5 in bf16, enough to move
    a log-prob by ~0.1 between two batch layouts, so that rho != 1 on the first pass and KL != 0 while
    pi = pi_ref), else fp32. `request` (response_logprobs): its next forward returns each token's
    log-prob of its label (and entropy) instead of the logits, _HeadLogprobs' fused chunks."""

    request = None

    def forward(self, x):
        dtype = _head_dtype(x, self.weight)
        with torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else nullcontext():
            if self.request is not None:
                r, self.request = self.request, None
                knobs = (dtype, r["temperature"], r["truncate"], r["entropy"], r["entropy_grad"],
                         chunk_rows(x, None, V=self.weight.shape[0]))  # autograd.Function.apply takes no keywords
                logp, ent = _HeadLogprobs.apply(x.reshape(-1, x.shape[-1]), self.weight, self.bias, r["labels"].reshape(-1),
                                                *knobs)  # (N,) each
                return torch.stack([logp] if ent is None else [logp, ent], -1).view(*x.shape[:-1], -1)  # (..., 1 | 2)
            if dtype == torch.bfloat16 and self.bias is None:
                return _HeadMatmul.apply(x.to(dtype), self.weight.to(dtype))
            return torch.nn.functional.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


def fused_head(model):
    """The model's FP32Head where its forward returns what that head computes, unchanged (no final
    softcapping, logit scale or other rescaling of the logits: Gemma 2's, Cohere's, Granite's); else None."""
    head, config = model.get_output_embeddings(), model.config.get_text_config()
    rescaled = any(getattr(config, k, None) not in (None, 1, 1.0) for k in
                   ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"))
    return head if type(head) is FP32Head and not rescaled else None
