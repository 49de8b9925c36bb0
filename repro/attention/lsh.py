"""Reformer's LSH attention (Kitaev et al., 2020) as the paper's baseline used it.

Queries and keys share one projection: the keys are the normalised queries, k = q / |q|.
Each hashing round draws random hyperplanes R (D, n_buckets / 2) and puts a token in bucket
argmax([k R, -k R]): one R per head (planes="per_head", default) or one R for all heads
(planes="shared", as the authors' library fast-transformers draws them). redraw says when R is
drawn anew: "train" (every training pass, fixed in eval and saved with the model: eval is
deterministic; default), "always" (every call, eval included: fast-transformers) or "never".
Tokens are sorted by (bucket, position) and cut into chunks of `chunk_size`; a query attends
to the keys of its own chunk and of the previous one (no wrap-around), causally by position
when causal. A token attends to itself only when nothing
else is left (its own score q.k would dominate, the keys being the normalised queries).
Rounds are combined by their log-sum-exp weights as in Reformer (combine="lse"), or averaged
as in the authors' library fast-transformers (combine="mean"); a key met in several rounds
counts once per round (no duplicate correction). Memory is O(N * chunk_size) per round;
any N works (padded inside to a multiple of chunk_size; the authors' library needs N to be
a multiple of the chunk). attention_dropout drops attention weights within each round in
training (fast-transformers: 0.1; default 0).

Causality, honestly stated: a query only ever reads keys at positions <= its own, so no
token's content reaches an earlier output. Which earlier keys share its chunk, though, depends
on how many tokens (future ones included) fall in lower buckets: a property of Reformer's
sort-and-chunk scheme, which the paper's LSH baseline shares. (In training, a target token's
bucket can thus shift the chunk boundaries seen by the position that predicts it.)
With n_buckets=1 the chunks are plain position blocks and the layer is strictly causal.

There is no recurrent form: the paper generated with LSH by re-running the prefix, and
`layer.step` says so.
"""
import torch
import torch.nn.functional as F

from repro.attention.base import AttentionLayer
from repro.kernels.plumbing.dtypes import accumulation_dtype

COMBINE = ("lse", "mean")
PLANES = ("per_head", "shared")
REDRAW = ("train", "always", "never")


class LSHAttention(AttentionLayer):
    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, n_buckets: int = 64,
                 chunk_size: int = 32, n_hashes: int = 4, combine: str = "lse", redraw: str | bool = "train",
                 planes: str = "per_head", attention_dropout: float = 0.0):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if n_buckets < 1 or (n_buckets > 1 and n_buckets % 2):
            raise ValueError(f"lsh: n_buckets must be 1 or a positive even number; got {n_buckets}")
        if chunk_size < 1 or n_hashes < 1:
            raise ValueError(f"lsh: chunk_size and n_hashes must be >= 1; got chunk_size={chunk_size}, "
                             f"n_hashes={n_hashes}")
        if combine not in COMBINE:
            raise ValueError(f"lsh: unknown combine {combine!r}; valid: {', '.join(COMBINE)}")
        redraw = {True: "train", False: "never"}.get(redraw, redraw)  # the former bool setting
        if redraw not in REDRAW:
            raise ValueError(f"lsh: unknown redraw {redraw!r}; valid: {', '.join(REDRAW)}")
        if planes not in PLANES:
            raise ValueError(f"lsh: unknown planes {planes!r}; valid: {', '.join(PLANES)}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"lsh: attention_dropout must be in [0, 1); got {attention_dropout}")
        self.n_buckets, self.chunk_size, self.n_hashes = n_buckets, chunk_size, n_hashes
        self.combine, self.redraw, self.planes, self.attention_dropout = combine, redraw, planes, attention_dropout
        self.k_proj = None  # shared query/key projection: no parameters of its own
        # (R, H or 1, D, n_buckets / 2): saved with the model, so a fixed-in-eval layer hashes
        # the same after loading.
        heads = n_heads if planes == "per_head" else 1
        self.register_buffer("rotations", torch.randn(n_hashes, heads, self.d_keys, max(1, n_buckets // 2)))

    def new_rotations(self):
        self.rotations.normal_()

    def forward(self, x, causal: bool = False, key_padding_mask=None):
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"LSHAttention: x must be (B, N, d_model={self.d_model}); got {tuple(x.shape)}")
        if key_padding_mask is not None and (key_padding_mask.shape != x.shape[:2]
                                             or key_padding_mask.dtype != torch.bool):
            raise ValueError(f"LSHAttention: key_padding_mask must be bool (B, N) = {tuple(x.shape[:2])}; "
                             f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
        if self.redraw == "always" or (self.redraw == "train" and self.training):
            self.new_rotations()
        q = self._heads(x, self.q_proj, self.d_keys)  # (B, H, N, D)
        v = self._heads(x, self.v_proj, self.d_values)  # (B, H, N, M)
        y = self.attend(q, F.normalize(q, dim=-1), v, causal=causal, key_padding_mask=key_padding_mask)
        return self.out_proj(y.transpose(1, 2).flatten(-2))

    @torch.no_grad()
    def _hash(self, k):
        """(B, H, N, D) -> buckets (R, B, H, N)."""
        if self.n_buckets == 1:
            return k.new_zeros((self.n_hashes,) + k.shape[:-1], dtype=torch.long)
        planes = self.rotations.float().expand(-1, k.shape[1], -1, -1)  # (R, H, D, K): shared planes broadcast
        rot = torch.einsum("bhnd,rhdk->rbhnk", k.float(), planes)
        return torch.cat([rot, -rot], -1).argmax(-1)

    def attend(self, q, k, v, causal, key_padding_mask):
        """q: (B, H, N, D), k: the keys (normalised q), v: (B, H, N, M) -> (B, H, N, M)."""
        b, h, n, _ = q.shape
        c = self.chunk_size
        pad = (-n) % c
        padding = key_padding_mask if key_padding_mask is not None else q.new_zeros(b, n, dtype=torch.bool)
        padding = F.pad(padding, (0, pad), value=True)[:, None, :].expand(b, h, n + pad)  # (B, H, Np)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        buckets = self._hash(k).masked_fill(padding, self.n_buckets)  # padding sorts last
        outs, lses = [], []
        for r in range(self.n_hashes):
            perm = (buckets[r] * (n + pad) + torch.arange(n + pad, device=q.device)).argsort(-1)  # (B, H, Np)
            o, lse = self._attend_sorted(q, k, v, perm, padding, causal)
            undo = perm.argsort(-1)
            outs.append(o.gather(2, undo[..., None].expand_as(o)))
            lses.append(lse.gather(2, undo))
        out = torch.stack(outs)  # (R, B, H, Np, M)
        if self.combine == "lse":
            w = torch.stack(lses).softmax(0)  # each round weighted by its share of the total mass
        else:
            w = out.new_full(out.shape[:-1], 1.0 / self.n_hashes)
        return (out * w[..., None]).sum(0)[:, :, :n].to(v.dtype)

    def _attend_sorted(self, q, k, v, perm, padding, causal):
        """One round on the (bucket, position)-sorted sequence; perm holds the positions."""
        b, h, npad, d = q.shape
        c = self.chunk_size
        nc = npad // c
        acc = accumulation_dtype(q.dtype)

        def chunks(t):  # sorted, (B, H, Np, X) -> (B, H, nc, C, X)
            return t.gather(2, perm[..., None].expand(-1, -1, -1, t.shape[-1])).to(acc).unflatten(2, (nc, c))

        def look_back(t):  # (B, H, nc, C, ...) -> (B, H, nc, 2C, ...): previous chunk, then own
            return torch.cat([t.roll(1, 2), t], 3)

        qc, kc, vc = chunks(q), look_back(chunks(k)), look_back(chunks(v))
        qpos = perm.unflatten(2, (nc, c))  # (B, H, nc, C)
        kpos = look_back(qpos)
        first = torch.zeros(nc, 2 * c, dtype=torch.bool, device=q.device)
        first[0, :c] = True  # chunk 0 has no previous chunk
        own = torch.zeros(2 * c, dtype=torch.bool, device=q.device)
        own[c:] = True
        kvalid = ~look_back(padding.gather(2, perm).unflatten(2, (nc, c))) & ~first  # (B, H, nc, 2C)
        allowed = kvalid[..., None, :].expand(-1, -1, -1, c, -1)  # (B, H, nc, C, 2C)
        if causal:
            allowed = allowed & (kpos[..., None, :] <= qpos[..., None])
        self_ = (kpos[..., None, :] == qpos[..., None]) & own
        others = allowed & ~self_
        mask = torch.where(others.any(-1, keepdim=True), others, self_)  # self only when alone
        scores = (qc @ kc.transpose(-1, -2)) * d ** -0.5  # (B, H, nc, C, 2C)
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = scores.logsumexp(-1)  # (B, H, nc, C): finite, every row keeps at least itself
        a = (scores - lse[..., None]).exp()  # (B, H, nc, C, 2C): the attention weights
        if self.training and self.attention_dropout:
            a = F.dropout(a, self.attention_dropout)
        o = a @ vc  # (B, H, nc, C, M)
        return o.flatten(2, 3), lse.flatten(2)
