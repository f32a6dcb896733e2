#!/usr/bin/env python3
"""normref's training step written as a JAX user writes it: the benchmark peer.

    python3 bench/peer_jax.py --n-layer 12 --n-embd 768 --n-head 12 --vocab-size 50257 \
        --batch 4 --seq 64 --steps 3 --threads 2

The model is the Pre-LN GPT-2 of normref's float32 step (learned positions, LayerNorm with
bias, biased linear maps, tanh GELU, the head tied to the token embedding, mean cross-entropy),
a pure function of a dictionary of float32 arrays; jax.nn.dot_product_attention(is_causal=True)
where the version has it, else the masked softmax; optax's AdamW with the GPT-2 decay mask
(matrices decay, vectors do not) where optax is installed, else the same update written out.
One step (gradients by value_and_grad, the update, the new parameters) is one jax.jit function
whose parameters and moments are donated, so that XLA updates them in place.

A step is what normref's step is: forward with the loss, backward, one AdamW update (JAX has
no gradients to zero).  After --warmup steps (the first compiles), --steps are timed, each
waited for with block_until_ready.  The threads: XLA's CPU client runs a step's operations on
one pool of intra-op threads as large as the cores the process may use, so --threads pins the
process to that many cores (sched_setaffinity) before JAX starts; XLA_FLAGS gets
--xla_cpu_multi_thread_eigen=true, which lets a single Eigen operation use them all.  The
output is one line of key=value words as bench/peer_torch.py prints.  Exit status 77 when
JAX is absent.
"""
import argparse
import math
import os
import resource
import statistics
import sys
import time
from peak_memory import hwm_mib, hwm_reset


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:a.threads])
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=true").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("peer_jax: JAX is not installed for %s" % sys.executable, file=sys.stderr)
        sys.exit(77)
    try:
        import optax
    except ImportError:
        optax = None

    L, d, h, V, B, T = a.n_layer, a.n_embd, a.n_head, a.vocab_size, a.batch, a.seq
    dk = d // h

    def init(key):
        keys = iter(jax.random.split(key, 4 * L + 2))

        def normal(shape, std):
            return std * jax.random.normal(next(keys), shape, jnp.float32)
        p = {"wte": normal((V, d), 0.02), "wpe": normal((T, d), 0.02),
             "ln_f.w": jnp.ones(d), "ln_f.b": jnp.zeros(d), "blocks": []}
        res = 0.02 / math.sqrt(2 * L)
        for _ in range(L):
            p["blocks"].append({
                "ln_1.w": jnp.ones(d), "ln_1.b": jnp.zeros(d),
                "attn.w": normal((d, 3 * d), 0.02), "attn.b": jnp.zeros(3 * d),
                "proj.w": normal((d, d), res), "proj.b": jnp.zeros(d),
                "ln_2.w": jnp.ones(d), "ln_2.b": jnp.zeros(d),
                "up.w": normal((d, 4 * d), 0.02), "up.b": jnp.zeros(4 * d),
                "down.w": normal((4 * d, d), res), "down.b": jnp.zeros(d)})
        return p

    def layer_norm(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * w + b

    def attention(x, p):
        q, k, v = jnp.split(x @ p["attn.w"] + p["attn.b"], 3, axis=-1)
        q, k, v = (t.reshape(B, T, h, dk) for t in (q, k, v))
        if hasattr(jax.nn, "dot_product_attention"):
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dk)
            s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
            y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return y.reshape(B, T, d) @ p["proj.w"] + p["proj.b"]

    def loss_fn(params, tokens, targets):
        x = params["wte"][tokens] + params["wpe"][None, :T]
        for p in params["blocks"]:
            x = x + attention(layer_norm(x, p["ln_1.w"], p["ln_1.b"]), p)
            u = jax.nn.gelu(layer_norm(x, p["ln_2.w"], p["ln_2.b"]) @ p["up.w"] + p["up.b"],
                            approximate=True)
            x = x + u @ p["down.w"] + p["down.b"]
        logits = layer_norm(x, params["ln_f.w"], params["ln_f.b"]) @ params["wte"].T
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return (logz - picked).mean()

    params = init(jax.random.PRNGKey(1))
    mask = jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
    if optax is not None:
        tx = optax.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask)
        opt_state, flavour = tx.init(params), "optax"

        def update(grads, state, params):
            upd, state = tx.update(grads, state, params)
            return optax.apply_updates(params, upd), state
    else:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        opt_state, flavour = (zeros, zeros, jnp.zeros((), jnp.int32)), "written-out"

        def update(grads, state, params):
            m, v, t = state
            t = t + 1
            m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
            v = jax.tree_util.tree_map(lambda v, g: 0.95 * v + 0.05 * g * g, v, grads)
            c1, c2 = 1 - 0.9 ** t, 1 - 0.95 ** t

            def one(p, m, v, decay):
                p = p - 3e-4 * 0.1 * p if decay else p
                return p - 3e-4 * (m / c1) / (jnp.sqrt(v / c2) + 1e-8)
            return jax.tree_util.tree_map(one, params, m, v, mask), (m, v, t)

    def train_step(params, state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        params, state = update(grads, state, params)
        return params, state, loss
    step = jax.jit(train_step, donate_argnums=(0, 1))

    rng = jax.random.split(jax.random.PRNGKey(2))
    tokens = jax.random.randint(rng[0], (B, T), 0, V)
    targets = jax.random.randint(rng[1], (B, T), 0, V)
    jax.block_until_ready((params, opt_state, tokens, targets))
    reset = hwm_reset()
    times, t_start, warm_s = [], time.perf_counter(), 0.0
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens, targets)
        jax.block_until_ready((params, loss))
        t = time.perf_counter() - t0
        if s == a.warmup - 1:
            warm_s = time.perf_counter() - t_start
        if s >= a.warmup:
            times.append(t)
    med, fast = statistics.median(times), min(times)
    N = B * T
    print("impl=jax-%s threads=%d adamw=%s sdpa=%d B=%d T=%d step_s=%.6f min_s=%.6f "
          "tokens_per_s=%.1f max_tokens_per_s=%.1f warmup_s=%.3f peak_rss_mib=%.1f "
          "max_rss_mib=%.1f loss=%.4f" %
          (jax.__version__, len(os.sched_getaffinity(0)), flavour,
           int(hasattr(jax.nn, "dot_product_attention")), B, T, med, fast, N / med, N / fast,
           warm_s, hwm_mib() if reset else -1.0,
           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, float(loss)))


if __name__ == "__main__":
    main()
