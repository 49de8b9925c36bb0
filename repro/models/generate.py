"""Sampling a sequence from an autoregressive model, the three ways the paper compares:

  recurrent  one model.step per token: linear attention's RNN form, softmax's key/value cache
             (the paper's "stateful softmax"); constant (linear) or growing (cache) cost per token
  rerun      the whole prefix through the parallel forward for every new token: the paper's
             softmax baseline, and the only way for attentions without a recurrent form (LSH)

compile_step puts the recurrent step, and the sampling after it, through torch.compile;
GraphedSteps replays the whole step (every layer, and the sampling) as one CUDA graph, for a
state of fixed size (linear attention and its successors; softmax's cache with static_cache).
"""
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

MODES = ("recurrent", "rerun")
# Inductor settings for the compiled step. At batch 1 every tensor in a step holds a few hundred
# values, so storing an intermediate costs nothing, while inductor's default store-or-recompute
# choice recomputes phi (an exp) inside the state's loops once per value of v (measured at
# MNIST size, one CPU thread: that kernel took 45 us per layer, 0.36 ms of a 1.8 ms step, and
# 7 us with these settings). The C++ wrapper calls the step's kernels without Python between
# them (CPU only: measured there, 0.05 ms a step).
STEP_INDUCTOR = {"realize_reads_threshold": 1, "realize_opcount_threshold": 1, "realize_acc_reads_threshold": 1}
STEP_INDUCTOR_CPU = {**STEP_INDUCTOR, "cpp_wrapper": True}

# Tokens sampled per call of a compiled sampling step (the steps unrolled in one graph). Each
# call pays a fixed cost outside the graph (dynamo's frame: gathering ~160 weight and state
# tensors, the graph's wrapper, the state's outputs), about 0.2 ms at MNIST size on one CPU
# thread against ~1.25 ms of graph: measured (python -m repro.reproduction.cpu_speed --rows
# generation), 1.49x the matvec floor at 1 token per call, 1.30x at 2, 1.20x at 4, while the
# compile time grows with the graph (about 30, 55 and 105 s at MNIST size).
TOKENS_PER_CALL = 2


class StepProjections:
    """Generation's projections around one attention layer's step (layer.step_projections): q,
    k and v in one matmul over the concatenated weights, since per-token cost at batch 1 is
    mostly per-op overhead, and both products as addmm on a transposed weight, a faster kernel
    than F.linear there. The concatenation is cached while the parameters are unchanged (their
    storage and version counters are the key, so an optimizer step, load_state_dict or .to()
    rebuilds it). With autograd on (training through the step) the layer takes its plain
    modules. Traced by torch.compile, the cache (keyed on data pointers, which dynamo cannot
    trace) is read as it stands: only compile_step, whose wrapper refreshes it before every
    generation, lets a compiled step use it (refreshed=True); other compiled steps take the
    plain modules."""

    def __init__(self, layer, refreshed: bool = False):
        self.layer, self.refreshed = layer, refreshed
        self._key, self._wb = None, None

    def usable(self) -> bool:
        return not torch.is_grad_enabled() and (self.refreshed or not torch.compiler.is_compiling())

    def weights(self):
        """(W_q; W_k; W_v)^T (d_model, 2 H D + H M) and the biases (2 H D + H M,)."""
        mods = (self.layer.q_proj, self.layer.k_proj, self.layer.v_proj)
        params = [p for m in mods for p in (m.weight, m.bias)]
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        if self._key != key:
            self._wb, self._key = (torch.cat([m.weight for m in mods]).t(), torch.cat(params[1::2])), key
        return self._wb

    def qkv(self, x):
        """(B, d_model) -> q, k (B, H D), v (B, H M)."""
        w, b = self._wb if torch.compiler.is_compiling() else self.weights()
        hd, hm = self.layer.n_heads * self.layer.d_keys, self.layer.n_heads * self.layer.d_values
        return torch.addmm(b, x, w).split([hd, hd, hm], -1)

    def out(self, y):
        """(B, H M) -> (B, d_model): F.linear's op."""
        o = self.layer.out_proj
        return torch.addmm(o.bias, y, o.weight.t())


def recurrent_layers(model):
    from repro.attention.base import AttentionLayer
    return [m for m in model.modules() if isinstance(m, AttentionLayer) and m.recurrent]


def fast_projections(model, refreshed: bool = False):
    """Gives every recurrent attention layer of the model its StepProjections (a layer that has
    them keeps them, unless compile_step asks for refreshed ones); returns those layers."""
    layers = recurrent_layers(model)
    for layer in layers:
        if refreshed or layer.step_projections is None:
            layer.step_projections = StepProjections(layer, refreshed)
    return layers


@dataclass
class SamplingStep:
    """A model's step with sample_fn applied to its outputs, compiled by compile_step:
    first (tokens (B,), state) -> (next tokens (B,), state), one token;
    several (tokens (B,), state) -> (next tokens (B, n), state), n = tokens_per_call tokens, each
    fed back in, in one graph."""
    sample_fn: Callable
    first: Callable
    several: Callable
    tokens_per_call: int


def _leaves(state) -> tuple[list, list]:
    """(tensors, other values) of a step's state (dataclasses, lists, tuples, dicts), in order."""
    if isinstance(state, torch.Tensor):
        return [state], []
    if dataclasses.is_dataclass(state):
        parts = [_leaves(getattr(state, f.name)) for f in dataclasses.fields(state)]
    elif isinstance(state, (list, tuple)):
        parts = [_leaves(s) for s in state]
    elif isinstance(state, dict):
        parts = [_leaves(state[k]) for k in sorted(state)]
    else:
        return [], [state]
    return [t for ts, _ in parts for t in ts], [o for _, os in parts for o in os]


def _rebuilt(state, tensors):
    """The state's structure (fresh containers) holding `tensors` in _leaves order: a step may set
    fields of the state it is given (retention's S = gamma S + k v^T), never the static one's."""
    it = iter(tensors)

    def build(s):
        if isinstance(s, torch.Tensor):
            return next(it)
        if dataclasses.is_dataclass(s):
            out = copy.copy(s)
            for f in dataclasses.fields(s):
                setattr(out, f.name, build(getattr(s, f.name)))
            return out
        if isinstance(s, (list, tuple)):
            return type(s)(build(x) for x in s)
        if isinstance(s, dict):
            return {k: build(s[k]) for k in sorted(s)}
        return s
    return build(state)


class GraphedSteps:
    """One sampled token per call of model.step + sample_fn, replayed as one CUDA graph over
    static buffers (the tokens in, the state, the tokens out), for a state of fixed size: per-token
    cost at batch 1 is mostly kernel launches, which a graph issues as one. The position is a
    tensor on the device (GenerationState.position), so one graph serves every position.

    start(prefix) runs the prefix eagerly (the state is built there), samples the next token and
    copies the state into the static buffers; each next() then samples one more token (a view of
    the static output: copy it before the next call). The graph reads tensors by the address they
    had at capture, and holds the ones it does not own (the position table, the fused q/k/v
    weights); a later start() whose weights or table were rebuilt (training, .to(), a longer
    sequence) is a ValueError: make a new GraphedSteps. A state that changes size or holds Python
    values that change (a key/value cache's length) cannot be one graph: a ValueError says so,
    as for a static cache too small for the sequence.
    capture=False runs the same static-buffer step without a graph (any device: what the CPU
    tests check)."""

    def __init__(self, model, sample_fn, capture: bool = True):
        self.model, self.sample_fn, self.capture = model, sample_fn, capture
        self.graph = self.state = self.tokens = self.out = None

    def _step(self, tokens, state):
        y, state = self.model.step(tokens, state)
        return self.sample_fn(y), state

    def _body(self):
        out, new = self._step(self.tokens, _rebuilt(self.state, self._static))
        for old, t in zip(self._static, _leaves(new)[0]):
            if t is not old:  # a state updated in place (linear's S and Z) needs no copy
                old.copy_(t)
        self.tokens.copy_(out)  # the next step's input
        return out

    def _inputs_read(self) -> list:
        """What the graph reads but does not own: the position table and each layer's fused q/k/v
        weights (rebuilt, and the old freed, when the parameters change)."""
        return [getattr(self.model, "_pe", None)] + [layer.step_projections._wb
                                                     for layer in recurrent_layers(self.model)]

    def start(self, prefix, length: int):
        """prefix (B, k) -> the token at position k (B,)."""
        from repro.models.autoregressive import GenerationState

        for layer in recurrent_layers(self.model):  # a static cache is written at slots 0..length - 2
            if getattr(layer, "static_cache", False) and length - 1 > layer.initial_cache:
                raise ValueError(f"GraphedSteps: a static cache of initial_cache={layer.initial_cache} slots "
                                 f"cannot take {length - 1} tokens: set initial_cache to the sequence's length")
        fast_projections(self.model)
        self.model._position(length, prefix.device)  # the position table, grown before any capture
        state = GenerationState(torch.zeros((), dtype=torch.long, device=prefix.device), [])
        for t in range(prefix.shape[1] - 1):
            _, state = self.model.step(prefix[:, t], state)
        out, state = self._step(prefix[:, -1], state)  # (rebuilds the fused weights if the parameters changed)
        if self.graph is not None and any(a is not b for a, b in zip(self._read, self._inputs_read())):
            raise ValueError("GraphedSteps: the weights or the position table changed since the graph was "
                             "captured (training, .to(), a longer sequence): make a new GraphedSteps")
        if self.state is None:
            self._prepare(out, state)
        elif self.tokens.shape != out.shape:
            raise ValueError(f"GraphedSteps: made for batch {self.tokens.shape[0]}, given {out.shape[0]}: "
                             "make one for each batch size")
        for old, t in zip(self._static, _leaves(state)[0]):
            old.copy_(t)
        self.tokens.copy_(out)
        return out

    def _prepare(self, out, state):
        """The static buffers, checked to keep their shapes and values over two steps, and the graph."""
        tensors, others = _leaves(state)
        static = copy.deepcopy(state)  # the probe steps the copy that becomes the static state: no third copy
        rng = torch.random.fork_rng(devices=[out.device] if out.is_cuda else [])
        with rng:  # the probe and the warm-up draw no random numbers of the generation's
            _, after = self._step(out.clone(), static)
        tensors2, others2 = _leaves(after)
        grown = [f"{tuple(a.shape)} -> {tuple(b.shape)}" for a, b in zip(tensors, tensors2) if a.shape != b.shape]
        if grown or len(tensors) != len(tensors2) or others != others2:
            changed = grown or [f"{a!r} -> {b!r}" for a, b in zip(others, others2) if a != b] or ["its structure"]
            raise ValueError(f"GraphedSteps: the step's state changes from one token to the next ({changed[0]}): "
                             "one CUDA graph replays only a state of fixed size (linear attention, its successors, "
                             "softmax with static_cache=true), not a growing key/value cache")
        del after, tensors2
        self.tokens, self._static = out.clone(), _leaves(static)[0]
        if self.capture:
            self.state = static  # (for _body; unset again if the capture fails)
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.random.fork_rng(devices=[out.device]), torch.cuda.stream(side):
                    for _ in range(2):  # warm-up on a side stream (lazy inits, cuBLAS workspaces)
                        self._body()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.out = self._body()
            except BaseException:
                self.state = self.tokens = None
                raise
            self.graph, self._read = graph, self._inputs_read()  # held: the graph reads them by address
        self.state = static

    def next(self):
        """The next token (B,), from the token and state of the call before."""
        if self.graph is None:
            return self._body()
        self.graph.replay()
        return self.out


@torch.no_grad()
def generate(model, prefix, length: int, sample_fn, mode: str = "recurrent", on_step=None, graphed=None):
    """prefix (B, k >= 1) tokens -> (B, length): the prefix, then sampled tokens.

    sample_fn maps the model's outputs at one position (B, d_out) to tokens (B,). on_step(t) is
    called after each sampled position t (for progress bars and timing). A model compiled by
    compile_step with this same sample_fn samples inside its compiled step. graphed: a
    GraphedSteps of this model and sample_fn (recurrent mode), whose graph is made on its first
    generation and replayed for every token after the prefix's."""
    if mode not in MODES:
        raise ValueError(f"generate: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    b, k = prefix.shape
    if not 1 <= k <= length:
        raise ValueError(f"generate: the prefix must hold 1..length={length} tokens; got {k}")
    seq = prefix.new_empty(b, length)
    seq[:, :k] = prefix
    if graphed is not None:
        if mode != "recurrent" or graphed.sample_fn is not sample_fn:
            raise ValueError("generate: graphed steps run the recurrent mode with their own sample_fn")
        if k < length:
            seq[:, k] = graphed.start(prefix, length)
            for t in range(k, length):
                if on_step:
                    on_step(t)
                if t + 1 < length:
                    seq[:, t + 1] = graphed.next()
        return seq
    if mode == "recurrent":
        fast_projections(model)
        sampling = getattr(model, "sampling_step", None)
        if sampling is None or sampling.sample_fn is not sample_fn:
            def one(tokens, state):
                y, state = model.step(tokens, state)
                return sample_fn(y), state
            sampling = SamplingStep(sample_fn, one, None, 1)
        state, t = None, 0
        while t < length - 1:  # feeding token t yields the distribution of token t + 1
            if t + 1 < k:  # inside the prefix: nothing to sample (and no random numbers drawn)
                _, state = model.step(seq[:, t], state)
                t += 1
                continue
            n = sampling.tokens_per_call
            if state is None or n == 1 or t + n > length - 1:  # the first token, and a short tail
                seq[:, t + 1], state = sampling.first(seq[:, t], state)
                n = 1
            else:
                seq[:, t + 1:t + 1 + n], state = sampling.several(seq[:, t], state)
            for j in range(t + 1, t + 1 + n) if on_step else ():
                on_step(j)
            t += n
    else:
        for t in range(k, length):
            seq[:, t] = sample_fn(model(seq[:, :t])[:, -1])
            if on_step:
                on_step(t)
    return seq


def compile_step(model, backend: str = "inductor", sample_fn=None, tokens_per_call: int = TOKENS_PER_CALL):
    """Compile a model's recurrent `step` in place, and with sample_fn also its step followed by
    sample_fn (model.sampling_step, which generate uses when given that sample_fn): one graph
    for one token, and one for tokens_per_call tokens in a row (see TOKENS_PER_CALL). Returns
    the model.

    dynamic=True keeps the position symbolic, so the step is one graph for every position
    (softmax's key/value cache compiles again each time it doubles: give it room for the whole
    sequence with its initial_cache). Tokens are copied to a fresh (B,) tensor first: generation
    passes a column of its (B, length) buffer, whose stride (length, even where B = 1 makes it
    "contiguous") would otherwise be a guard, and a generation of another length a recompile.

    The attention layers' fused q/k/v weights (StepProjections) are rebuilt, where their
    parameters changed, at every first step (no state yet), so the compiled step reads them as
    they stand."""
    if tokens_per_call < 1:
        raise ValueError(f"compile_step: tokens_per_call must be >= 1; got {tokens_per_call}")
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    options = (STEP_INDUCTOR_CPU if on_cpu else STEP_INDUCTOR) if backend == "inductor" else None
    step = type(model).step.__get__(model)
    layers = fast_projections(model, refreshed=True)

    def refreshing(compiled):
        def call(tokens, state=None):
            if state is None:
                with torch.no_grad():
                    for layer in layers:
                        layer.step_projections.weights()
            return compiled(tokens.clone(memory_format=torch.contiguous_format), state)
        return call

    model.step = refreshing(torch.compile(step, backend=backend, dynamic=True, options=options))
    if sample_fn is not None:
        def first(tokens, state):
            y, state = step(tokens, state)
            return sample_fn(y), state

        def several(tokens, state):
            out = []
            for _ in range(tokens_per_call):  # unrolled: one graph, one call for all of them
                y, state = step(tokens, state)
                tokens = sample_fn(y)
                out.append(tokens)
            return torch.stack(out, 1), state  # (B, tokens_per_call)

        model.sampling_step = SamplingStep(
            sample_fn, *(refreshing(torch.compile(f, backend=backend, dynamic=True, options=options))
                         for f in (first, several)), tokens_per_call)
    return model
