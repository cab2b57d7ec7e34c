"""Hugging Face transformers on gfxgraph: ``generate()`` through the backend, and a graphed static-cache decoder.

Two ways, both for a causal LM with a static KV cache (transformers >= 4.46):

* :func:`compile_config` makes transformers' own ``generate()`` compile its decode
  step with ``backend="gfxgraph"`` instead of ``mode="reduce-overhead"``::

      out = model.generate(ids, max_new_tokens=64, cache_implementation="static",
                           compile_config=gfxgraph.hf.compile_config())

  transformers runs the prefill eagerly and the decode steps compiled. Each
  batch size gets a graph (bucketed, or of its exact size: the step writes the
  static cache, which is never padded), all in one memory pool.

* :class:`StaticCacheDecoder` is greedy or sampled decoding without ``generate()``'s per-token
  Python: one static cache and one captured decode step per batch size, called
  zero-copy (the step's inputs are written into the graph's own buffers).
  transformers 5's ``StaticCache`` keeps its write position on the device and
  advances it on every run, whatever ``cache_position`` says, so a capture ahead
  of time leaves the cache one step on; :meth:`StaticCacheDecoder.generate`
  resets the cache and runs the prefill before every generation, so no
  warm-up or capture run ever leaks into one. With ``device_loop=K`` the decode
  loop itself runs on the device: one graph launch decodes up to K tokens and
  stops at EOS there (a CUDA WHILE node; the host reads once per launch, not
  once per token; see :class:`~hipgraph_bridge.generation.DeviceDecodeLoop`).
  Left-padded prompts of different lengths take an ``attention_mask`` as
  ``generate()`` does: per-row positions, the padding masked in every step.

transformers is imported only when these are used (it is not a dependency of gfxgraph).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from hipgraph_bridge import ShapeBucketPool
from hipgraph_bridge.compile import BackendOptions
from hipgraph_bridge.compile.backend import register
from hipgraph_bridge.conditional.loop import LOOP_STRATEGIES
from hipgraph_bridge.checks import check_token_ids
from hipgraph_bridge.errors import ConfigError
from hipgraph_bridge.generation import DeviceDecodeLoop
from hipgraph_bridge.generation.device_loop import EosIds
from hipgraph_bridge.generation.sampling import SamplingParams, chooser

__all__ = ["compile_config", "StaticCacheDecoder"]


def compile_config(*, dynamic: bool | None = None, fullgraph: bool = False, **options: Any) -> Any:
    """A ``transformers.CompileConfig`` that compiles ``generate()``'s decode step with the gfxgraph backend.

    ``options`` are the backend's (``buckets=``, ``max_batch_size=``,
    ``compiler=``, ...; see :class:`~hipgraph_bridge.compile.BackendOptions`),
    checked here so a bad one fails now and not inside ``generate()``.
    ``dynamic`` is passed to ``torch.compile`` (None: dynamo makes the batch
    dimension dynamic at the second batch size it sees); ``fullgraph`` too.
    Every argument is checked before transformers is imported: a bad one raises
    :class:`~hipgraph_bridge.errors.ConfigError` (as :func:`gfxgraph.backend`
    does); without transformers this raises ``ImportError``.
    """
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ConfigError(f"compile_config(dynamic=...): expected None, True or False, got {dynamic!r}")
    if not isinstance(fullgraph, bool):
        raise ConfigError(f"compile_config(fullgraph=...): expected True or False, got {fullgraph!r}")
    BackendOptions.from_mapping(options)
    import transformers  # optional: only this integration needs it

    register()  # backend="gfxgraph" resolves even where the package's entry points are not installed
    # mode=None: torch.compile refuses a mode together with options, and the backend needs no mode
    return transformers.CompileConfig(backend="gfxgraph", mode=None, options=dict(options) or None,
                                      dynamic=dynamic, fullgraph=fullgraph)


FROM_CONFIG: Any = object()
"""``StaticCacheDecoder.generate``'s default EOS: the model's ``generation_config.eos_token_id``."""


def _check_causal_lm(model: Any) -> None:
    """Raise ``TypeError`` unless ``model`` is a transformers causal LM (decoder-only, with ``generate()``).

    A transformers model exists only once transformers is imported, so nothing is imported here."""
    tf = sys.modules.get("transformers")
    ok = (tf is not None and isinstance(model, tf.PreTrainedModel) and isinstance(model, tf.GenerationMixin)
          and not getattr(model.config, "is_encoder_decoder", False))
    if not ok:
        raise TypeError(f"model: expected a transformers causal LM (a decoder-only PreTrainedModel with generate(), "
                        f"e.g. transformers.AutoModelForCausalLM.from_pretrained(...)), got "
                        f"{type(model).__module__}.{type(model).__qualname__}")


@dataclass
class _Slot:
    """What one batch size owns: its cache, the step over it, and (with graphs) the step's zero-copy inputs
    or (with ``device_loop``) the decode loop over it.

    Left-padded batches: ``mask`` is the padding mask every decode step reads (``(batch, max_cache_len)``
    bool, written per generation: a row's padding False, the rest True; the causal mask hides what lies
    past the current position) and ``pads`` each row's padding length (the loop's step adds it to a
    row's position to get the cache position). Without a device loop the step with a mask is a graph
    of its own (``ragged_pool``/``ragged_io``), made at the first ragged generation."""

    cache: Any
    step: Any
    pool: ShapeBucketPool | None
    io: Any  # a StaticIO, or None without graphs
    capture_seconds: float
    loop: DeviceDecodeLoop | None = None
    mask: torch.Tensor | None = None
    pads: torch.Tensor | None = None
    ragged_pool: ShapeBucketPool | None = None
    ragged_io: Any = None


class StaticCacheDecoder:
    """Greedy or sampled decoding with a static KV cache and a captured decode step per batch size.

    Args:
        model: a transformers causal LM (``model(input_ids=..., position_ids=...,
            cache_position=..., past_key_values=cache)`` returning ``.logits``): a
            ``PreTrainedModel`` with ``generate()`` that is not an encoder-decoder,
            checked here (``TypeError`` otherwise).
        max_cache_len: the cache length; a generation's prompt plus new tokens must fit.
        graphs: False runs the same decode loop eagerly (the reference the tests compare with).
        device_loop: decode up to this many tokens per graph launch, EOS checked on the
            device (None: one graph replay and one host read per token).
        strategy: the device loop's strategy: ``"auto"``, ``"native"`` (CUDA WHILE nodes)
            or ``"host"`` (what HIP runs: one replay and one host read per token).

    One ``StaticCache`` and one graph per batch size, made on first use (or by
    :meth:`capture`); memory is the cache plus one pool of graph memory per
    batch size. The decoder is not thread-safe: one generation at a time.
    """

    def __init__(self, model: Any, *, max_cache_len: int, graphs: bool = True, device_loop: int | None = None,
                 strategy: str = "auto") -> None:
        _check_causal_lm(model)
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 2:
            raise ValueError(f"max_cache_len: expected an int >= 2, got {max_cache_len!r}")
        if device_loop is not None:
            if isinstance(device_loop, bool) or not isinstance(device_loop, int) or device_loop < 1:
                raise ValueError(f"device_loop: expected None or an int >= 1 (tokens per launch), got {device_loop!r}")
            if not graphs:
                raise ValueError("device_loop: expected graphs=True (the device loop is a captured graph)")
        if strategy not in LOOP_STRATEGIES:
            raise ValueError(f"strategy: expected one of {', '.join(LOOP_STRATEGIES)}, got {strategy!r}")
        if strategy != "auto" and device_loop is None:
            raise ValueError(f"strategy={strategy!r}: expected together with device_loop= (it is the device "
                             "loop's strategy)")
        self.device_loop = device_loop
        self.strategy = strategy
        self.model = model
        self.max_cache_len = max_cache_len
        self.graphs = graphs
        self._slots: dict[int, _Slot] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def capture(self, *batch_sizes: int) -> dict[int, float]:
        """Make the cache and capture the decode step for each batch size now; returns seconds per size."""
        return {b: self._slot(b).capture_seconds for b in batch_sizes}

    def _new_cache(self, batch: int) -> Any:
        from transformers import StaticCache  # optional: only this integration needs it

        try:  # transformers >= 5 takes the batch size from the first write
            return StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        except TypeError:
            return StaticCache(config=self.model.config, max_batch_size=batch, max_cache_len=self.max_cache_len,
                               device=self.device, dtype=self.model.dtype)

    def _slot(self, batch: int) -> _Slot:
        slot = self._slots.get(batch)
        if slot is not None:
            return slot
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch size: expected an int >= 1, got {batch!r}")
        cache, model, dev = self._new_cache(batch), self.model, self.device

        def step(ids: torch.Tensor, pos: torch.Tensor, cp: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
            logits = model(input_ids=ids, position_ids=pos, cache_position=cp, attention_mask=mask,
                           past_key_values=cache, use_cache=True).logits
            return logits[:, -1, :]  # the token is chosen outside the graph: greedy or sampled

        with torch.no_grad():  # the cache's tensors exist after a first write: a prefill of one token
            model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=dev),
                  cache_position=torch.zeros(1, dtype=torch.long, device=dev), past_key_values=cache, use_cache=True)
            if self.device_loop is not None:
                slot = self._slots[batch] = self._loop_slot(batch, cache)
                return slot
            pool = ShapeBucketPool(step, [batch], static_args=[2], stateful=True, copy_outputs=False, progress=False)
            t0 = time.perf_counter()
            example = (torch.zeros(batch, 1, dtype=torch.long, device=dev),
                       torch.ones(batch, 1, dtype=torch.long, device=dev), torch.ones(1, dtype=torch.long, device=dev))
            if self.graphs:
                pool.capture_all(*example)  # advances the cache: generate() resets it
            else:
                pool.close()
            seconds = time.perf_counter() - t0
        io = pool.static_io(batch) if self.graphs else None
        slot = self._slots[batch] = _Slot(cache, step, pool, io, seconds, mask=self._new_mask(batch))
        return slot

    def _new_mask(self, batch: int) -> torch.Tensor:
        return torch.ones(batch, self.max_cache_len, dtype=torch.bool, device=self.device)

    def _loop_slot(self, batch: int, cache: Any) -> _Slot:
        model = self.model
        mask = self._new_mask(batch)
        pads = torch.zeros(batch, dtype=torch.long, device=self.device)

        def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            if position.dim() == 0:  # every row at one position: no padding, no mask
                logits = model(input_ids=tokens.view(batch, 1), position_ids=position.view(1, 1).expand(batch, 1),
                               cache_position=position.view(1), past_key_values=cache, use_cache=True).logits
            else:  # left-padded rows: (batch,) positions; the cache position is a row's plus its padding
                logits = model(input_ids=tokens.view(batch, 1), position_ids=position.view(batch, 1),
                               cache_position=torch.add(position[:1], pads[:1]), attention_mask=mask,
                               past_key_values=cache, use_cache=True).logits
            return logits[:, -1, :]  # the loop chooses the token: greedy, or sampled in its body

        assert self.device_loop is not None
        loop = DeviceDecodeLoop(step, batch_size=batch, chunk=self.device_loop, device=self.device,
                                strategy=self.strategy)
        t0 = time.perf_counter()
        cache.reset()  # the warm-ups write from position 0 (after the one-token prefill they could pass a short cache)
        loop.capture()  # runs the step: generate() resets the cache
        return _Slot(cache, step, None, None, time.perf_counter() - t0, loop, mask=mask, pads=pads)

    def _ragged_io(self, slot: _Slot, batch: int) -> Any:
        """The zero-copy inputs of the step graph with a padding mask (made, and its capture run, at the
        first ragged generation of this batch size; the caller resets the cache afterwards)."""
        if slot.ragged_io is None:
            dev = self.device
            pool = ShapeBucketPool(slot.step, [batch], static_args=[2], stateful=True, copy_outputs=False,
                                   progress=False)
            example = (torch.zeros(batch, 1, dtype=torch.long, device=dev),
                       torch.ones(batch, 1, dtype=torch.long, device=dev),
                       torch.ones(1, dtype=torch.long, device=dev), self._new_mask(batch))
            slot.cache.reset()  # the capture's runs write from position 0, within the cache
            pool.capture_all(*example)
            slot.ragged_pool, slot.ragged_io = pool, pool.static_io(batch)
        return slot.ragged_io

    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 eos_token_id: EosIds | object = FROM_CONFIG, pad_token_id: int | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None) -> torch.Tensor:
        """Tokens after the prompt, shape ``(batch, n)`` with ``n <= max_new_tokens``: greedy, or sampled.

        ``do_sample=True`` draws each token as transformers' ``generate(do_sample=True)``
        does (``temperature``, then ``top_k``, then ``top_p``, at least one token kept),
        from a counter-based stream (:mod:`hipgraph_bridge.generation.sampling`): the
        token of row ``i`` chosen from the logits at position ``p`` uses the number at
        ``(seed, i, p)``, so a ``seed`` gives the same tokens with or without the
        device loop, for any ``device_loop`` chunk and strategy. The stream is not
        PyTorch's generator: the tokens differ from transformers' for the same seed.

        Prompts of different lengths come left-padded with an ``attention_mask``
        (``(batch, n)``, 1 for a real token, 0 for padding; each row's zeros before its
        ones), as ``generate()`` takes them and does with them: a row's positions count
        its real tokens only (``attention_mask.cumsum(-1) - 1``), its padding is masked
        out of every attention, and its stream positions for sampling are its own. A
        mask of all ones (or none) is the unpadded batch. As ``generate(do_sample=False)`` does: a sequence that produced
        an EOS id gets ``pad_token_id`` (default: the first EOS id) from then on,
        and decoding stops when every sequence has ended. The host reads one
        flag per token for that (as transformers does); without an EOS id it reads nothing.

        ``eos_token_id`` takes what transformers takes: an int, a list or tuple of
        ints (any of them ends a sequence; many checkpoints' generation configs
        carry a list), or an integer tensor. Left out, it is the model's
        ``generation_config.eos_token_id``; ``None`` given explicitly means no EOS
        (every sequence runs ``max_new_tokens``). The device loop compares with up
        to 8 EOS ids.
        With ``device_loop=K`` the EOS check is on the device and the host reads
        three numbers per launch of up to K tokens.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            got = (f"shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
                   else type(input_ids).__name__)
            raise ValueError(f"input_ids: expected a (batch, prompt) tensor of token ids (torch.long), got {got}")
        b, n = input_ids.shape
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if n + max_new_tokens > self.max_cache_len:
            raise ValueError(f"a prompt of {n} tokens plus max_new_tokens={max_new_tokens} needs a cache of "
                             f"{n + max_new_tokens}; expected at most max_cache_len={self.max_cache_len}")
        eos = self._eos_ids(eos_token_id)
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)
                                         or pad_token_id < 0):
            raise ValueError(f"pad_token_id: expected None or an int >= 0, got {pad_token_id!r}")
        params = SamplingParams(do_sample, temperature, top_k, top_p, seed)
        params = params.with_seed() if do_sample else params
        mask = _left_padding(attention_mask, input_ids)
        slot = self._slot(b)
        with torch.no_grad():
            return self._decode(slot, input_ids, mask, max_new_tokens, eos,
                                (eos[0] if eos else None) if pad_token_id is None else pad_token_id, params)

    def _eos_ids(self, eos_token_id: Any) -> tuple[int, ...]:
        """The EOS ids of a generation (empty: none), from the argument or the model's generation config."""
        if eos_token_id is FROM_CONFIG:
            config = getattr(self.model, "generation_config", None)
            eos_token_id = getattr(config, "eos_token_id", None)
            if eos_token_id is None:
                return ()
            return check_token_ids("model.generation_config.eos_token_id", eos_token_id)
        return () if eos_token_id is None else check_token_ids("eos_token_id", eos_token_id)

    def _decode(self, slot: _Slot, input_ids: torch.Tensor, mask: torch.Tensor | None, new: int,
                eos_ids: tuple[int, ...], pad: int | None, params: SamplingParams) -> torch.Tensor:
        b, n = input_ids.shape
        ragged = mask is not None
        kind = dict(top_k=params.top_k, top_p=params.top_p, ragged=ragged)
        if slot.loop is not None and not slot.loop.captured_for(params.do_sample, **kind):
            # the loop's body for this kind of generation: its warm-ups write the cache, so on an empty one
            # (a full earlier generation would put them past its end), reset again below
            slot.cache.reset()
            slot.loop.capture(do_sample=params.do_sample, **kind)
        if ragged and slot.loop is None and slot.io is not None:
            self._ragged_io(slot, b)  # its capture writes the cache: reset below
        slot.cache.reset()  # whatever capture, warm-up or an earlier generation wrote
        dev = input_ids.device
        if ragged:  # as generate() prepares a left-padded batch
            assert mask is not None and slot.mask is not None
            position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
            slot.mask[:, :n].copy_(mask)
            slot.mask[:, n:] = True  # the tokens to come; the causal mask hides those past the current one
            if slot.pads is not None:
                slot.pads.copy_(n - mask.long().sum(-1))
            logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                cache_position=torch.arange(n, device=dev), past_key_values=slot.cache,
                                use_cache=True).logits
            last = position_ids[:, -1]  # each row's last prompt position
        else:
            logits = self.model(input_ids=input_ids, cache_position=torch.arange(n, device=dev),
                                past_key_values=slot.cache, use_cache=True).logits
            last = torch.full((b,), n - 1, dtype=torch.long, device=dev)
        rows = torch.arange(b, device=dev)
        pick = chooser(params, logits.shape[-1], dev)  # the settings on the device once: no copy per token

        def choose(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # the token after (b,) positions pos
            return pick(scores, rows, pos)

        tok = choose(logits[:, -1, :], last)
        unfinished = torch.ones(b, dtype=torch.bool, device=dev)
        ends = bool(eos_ids)  # without an EOS id nothing ends: no pad id, no mask, no host read
        eos = torch.tensor(eos_ids, dtype=torch.long, device=dev)
        if slot.loop is not None:  # the prefill's token on the host side, the rest in launches of the loop
            if ends:
                unfinished &= ~torch.isin(tok, eos)
            rest = slot.loop.generate(tok, last + 1 if ragged else n, max_new_tokens=new - 1,
                                      eos_token_id=list(eos_ids) if ends else None,
                                      pad_token_id=pad if ends else None, unfinished=unfinished if ends else None,
                                      do_sample=params.do_sample, temperature=params.temperature,
                                      top_k=params.top_k, top_p=params.top_p, seed=params.seed)
            return torch.cat([tok.view(b, 1), rest], dim=1)
        if ragged and slot.io is not None:
            slot.ragged_io.args[3].copy_(slot.mask)  # the graph's own mask input, once per generation
        out = torch.empty(b, new, dtype=torch.long, device=dev)
        for i in range(new):
            if ends:
                tok = torch.where(unfinished, tok, pad)
                unfinished &= ~torch.isin(tok, eos)
            out[:, i] = tok
            if i == new - 1 or (ends and not bool(unfinished.any())):
                return out[:, :i + 1]
            tok = choose(self._step(slot, tok, last + 1 + i, n + i, ragged), last + 1 + i)
        return out

    def _step(self, slot: _Slot, tok: torch.Tensor, pos: torch.Tensor, cache_pos: int, ragged: bool) -> torch.Tensor:
        """The logits after ``tok`` at the rows' positions ``pos`` (``(batch,)``; cache position
        ``cache_pos``): the graph, written into zero-copy."""
        b = tok.shape[0]
        io = slot.ragged_io if ragged else slot.io
        if io is None:
            return slot.step(tok.view(b, 1), pos.view(b, 1), torch.full((1,), cache_pos, dtype=torch.long,
                                                                        device=tok.device),
                             slot.mask if ragged else None)
        ids, position_ids, cache_position = io.args[:3]
        ids.copy_(tok.view(-1, 1))
        position_ids.copy_(pos.view(-1, 1))
        cache_position.fill_(cache_pos)
        return io.run()  # overwritten by the next step: the token chosen from it is a new tensor


def _left_padding(attention_mask: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The padding mask of a left-padded batch as a bool tensor on the prompt's device, or None where
    no token is padding (the unpadded path). Raises ``ValueError`` for anything else: a mask of another
    shape, values other than 0 and 1, padding that is not on the left, or a row without a real token."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape) \
            or attention_mask.is_floating_point() or attention_mask.is_complex():
        got = (f"shape {tuple(attention_mask.shape)}, dtype {attention_mask.dtype}"
               if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__)
        raise ValueError(f"attention_mask: expected a {tuple(input_ids.shape)} tensor of 0/1 (integer or bool) like "
                         f"input_ids, got {got}")
    mask = attention_mask.to(device=input_ids.device)
    # one host read per generation (transformers' generate() reads the mask too)
    ok_values, left, nonempty, full = (bool(x) for x in torch.stack([
        ((mask == 0) | (mask == 1)).all(), (mask[:, 1:] >= mask[:, :-1]).all(), (mask[:, -1] == 1).all(),
        (mask == 1).all()]).tolist())
    if not ok_values:
        raise ValueError("attention_mask: expected 0 (padding) and 1 (a real token) only")
    if not left:
        raise ValueError("attention_mask: expected left padding (each row's zeros before its ones, as decoder-only "
                         "generation needs: pad with tokenizer.padding_side = 'left')")
    if not nonempty:
        raise ValueError("attention_mask: expected at least one real token in every row")
    return None if full else mask.bool()
