"""The frame step of Moshi + Mimi for many conversations at once (the torch engine's
module of the `moshi` pipeline).

Nothing of the networks is written here: every layer is transformers'
`MoshiForConditionalGeneration` (its temporal transformer `decoder`, its
`depth_decoder`, its embeddings) and its `MimiModel` (`audio_encoder`: the SEANet
encoder and decoder, their transformers, the split residual quantizer). What this
module adds is the state that lets one forward advance every live conversation by one
80 ms frame, each from its own past:

- `SlotCache`: a KV cache of fixed slots, one per conversation, each a ring of the
  last `window` positions with its own position counter. It fits where transformers'
  attention layers call `past_key_values.update`; each row of a step gets its own
  position ids (its RoPE angles) and an attention mask over its own valid entries, so
  conversations of different lengths share one batched attention and a conversation
  that joins or leaves does not disturb the others.
- Mimi's streaming encoder state per slot: the causal convolutions' padding caches
  (transformers' `MimiConv1dPaddingCache`, gathered for the rows of a step and written
  back after it; a fresh row starts as transformers starts a stream) and the encoder
  transformer's `SlotCache`. A conversation's codes equal transformers' own streaming
  `MimiModel.encode(..., use_streaming=True)` frame by frame.
- Mimi's decoder, which transformers does not stream: the upsampling transposed
  convolution runs on the last two frames (exact: a causal transposed convolution's
  output for a frame depends on that frame and the one before), the decoder
  transformer streams on its `SlotCache` (exact), and the SEANet decoder re-runs on the
  last `decode_window` frames (the newest frame's samples are kept). Against
  `MimiModel.decode` of the whole code sequence the samples match to within
  `DECODE_TOLERANCE` once a conversation is `decode_window` frames old; in its first
  frames the window's start is zeros where a whole decode pads each layer with zeros.
- The text token, the model's audio codes and the user's codes of the last frame (the
  acoustic delay: codebook 0 of frame t goes with codebooks 1-7 of frame t-1, as
  transformers' `build_delay_pattern_mask` lays them out; the first frame's delayed
  codebooks are the audio BOS), and a sampling generator seeded per conversation.

One step (`step`), for each row: Mimi encodes the user's 1920 samples to 8 codes; the
temporal transformer reads the previous text token, the model's previous (delayed)
codes and the user's (delayed) codes; the text head samples this frame's text token;
the depth decoder samples the model's 8 codebooks one after the other; the now
complete previous frame of the model's codes is decoded to 1920 samples (silence at a
conversation's first frame). Sampling is per row with the row's generator, so a
conversation's tokens and audio do not depend on who else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FRAME = 1920  # samples of one frame at 24 kHz (12.5 frames a second)
DECODE_WINDOW = 8  # frames the SEANet decoder re-runs over (its receptive field is shorter)
DECODE_TOLERANCE = 1e-4  # max |sample| difference to a whole decode, past the first window


class SlotCache:
    """Per-conversation KV rings of `window` positions for `layers` attention layers,
    shared by the rows of a step. `begin(rows, T)` starts a step of T new positions for
    those slots (and returns their position ids and attention mask); every layer's
    attention then calls `update`, which writes the new keys and values into each
    row's ring and returns what the row attends to."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, window: int, step_tokens: int, dtype: torch.dtype) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.window = window
        self.capacity = window + step_tokens  # the oldest entry a step's first query still sees survives its writes
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.slots = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.held = torch.empty(0, self.capacity, dtype=torch.long)  # absolute position in each ring entry (-1: empty)
        self.next = torch.empty(0, dtype=torch.long)
        self._rows = torch.empty(0, dtype=torch.long)
        self._idx = torch.empty(0, 0, dtype=torch.long)
        self._span = 0

    def grow(self, slots: int) -> None:
        if slots <= self.slots:
            return
        extra = slots - self.slots
        shape = (extra, self.kv_heads, self.capacity, self.head_dim)
        new = {"dtype": self.dtype, "device": self.device}
        if not self.k:
            self.k = [torch.zeros(shape, **new) for _ in range(self.layers)]
            self.v = [torch.zeros(shape, **new) for _ in range(self.layers)]
        else:
            self.k = [torch.cat([t, torch.zeros(shape, **new)]) for t in self.k]
            self.v = [torch.cat([t, torch.zeros(shape, **new)]) for t in self.v]
        self.held = torch.cat([self.held, torch.full((extra, self.capacity), -1, dtype=torch.long, device=self.device)])
        self.next = torch.cat([self.next, torch.zeros(extra, dtype=torch.long, device=self.device)])
        self.slots = slots

    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        """Move the rings with the model (`Module.to`'s conversion)."""
        self.k, self.v = [fn(t) for t in self.k], [fn(t) for t in self.v]
        self.held, self.next = fn(self.held), fn(self.next)
        self.dtype, self.device = dtype, device

    def reset(self, rows: torch.Tensor) -> None:
        self.held[rows] = -1
        self.next[rows] = 0

    def age(self, rows: torch.Tensor, positions: int) -> None:
        """Make each row's ring hold the last `positions` positions (its entries keep the
        keys and values they hold): a conversation that far along, whose steps attend
        over the whole window (the shapes bench times steady-state steps so)."""
        idx = torch.arange(self.capacity, device=self.device)
        last = positions - 1 - (positions - 1 - idx) % self.capacity  # the latest position each entry holds
        self.held[rows] = torch.where(last >= 0, last, torch.full_like(last, -1))
        self.next[rows] = positions

    def begin(self, rows: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.next[rows][:, None] + torch.arange(tokens, device=self.device)  # [B, T]
        idx = pos % self.capacity
        self.held[rows[:, None], idx] = pos
        self.next[rows] += tokens
        # while no row has wrapped its ring, only the first entries hold anything
        span = self.capacity if bool((self.next[rows] > self.capacity).any()) else int(self.next[rows].max())
        held = self.held[rows, :span]  # [B, S]
        age = pos[:, :, None] - held[:, None, :]  # [B, T, S]
        ok = (held[:, None, :] >= 0) & (age >= 0) & (age < self.window)
        mask = torch.zeros(ok.shape, dtype=self.dtype, device=self.device).masked_fill(~ok, torch.finfo(self.dtype).min)[:, None]
        self._rows, self._idx, self._span = rows, idx, span
        return pos, mask

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows, idx, span = self._rows, self._idx, self._span
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[rows[:, None], :, idx] = key.transpose(1, 2).to(k.dtype)  # [B, T, kv_heads, head_dim]
        v[rows[:, None], :, idx] = value.transpose(1, 2).to(v.dtype)
        return k[rows, :, :span], v[rows, :, :span]


class _RowPadding:
    """Transformers' `MimiConv1dPaddingCache` for the rows of one step: each conv
    layer's cache is gathered from the slots' saved state; rows that start a stream
    are initialised as transformers initialises a new stream (zeros, or the first
    sample repeated for replicate-padded layers)."""

    def __init__(self, template: Any, state: list[torch.Tensor], rows: torch.Tensor, fresh: torch.Tensor) -> None:
        from transformers.models.mimi.modeling_mimi import MimiConv1dPaddingCache

        self.cache = MimiConv1dPaddingCache(
            len(template["padding"]), template["padding"], template["modes"], template["channels"]
        )
        self.cache.padding_cache = [s[rows] for s in state]
        self.fresh = fresh
        init = self.cache._cache_init
        plain_update = self.cache.update

        def update(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
            if bool(self.fresh.any()):
                start = init(hidden_states, layer_idx)
                cur = self.cache.padding_cache[layer_idx]
                self.cache.padding_cache[layer_idx] = torch.where(self.fresh[:, None, None], start, cur)
            return plain_update(hidden_states, layer_idx)

        self.cache.update = update


class MoshiSteps(torch.nn.Module):
    """See the module docstring. `step` takes, per row: `slot` (int), `pcm` [1920]
    float32 at 24 kHz, `fresh` (bool: the slot starts a new conversation), `seed`
    (int, read when fresh), and sampling settings `text_temperature`, `audio_temperature`
    (0: greedy), `text_top_k`, `audio_top_k`. It returns per row: `pcm` [1920] (the
    model's voice, one frame behind its codes), `text` (the text token), `codes` [8]
    (the model's codes in the delayed layout) and `user_codes` [8] (Mimi's codes of the
    user's frame)."""

    def __init__(self, model: torch.nn.Module, decode_window: int = DECODE_WINDOW) -> None:
        super().__init__()
        self.moshi = model
        cfg = model.config
        self.codebooks = int(cfg.num_codebooks)
        self.audio_bos = int(cfg.audio_vocab_size)
        self.text_bos = int(cfg.vocab_size)
        mimi = model.audio_encoder
        mc = mimi.config
        if round(mc.sampling_rate / mc.frame_rate) != FRAME or mc.encodec_frame_rate != 2 * mc.frame_rate:
            raise ValueError(f"Mimi at {mc.sampling_rate} Hz / {mc.frame_rate} frames a second; this step is written for 24 kHz at 12.5 Hz")
        dtype = next(model.parameters()).dtype
        window = int(cfg.sliding_window or cfg.max_position_embeddings)
        self.lm_cache = SlotCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, window, 1, dtype)
        self.enc_cache = SlotCache(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, int(mc.sliding_window), 2, dtype)
        self.dec_cache = SlotCache(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, int(mc.sliding_window), 2, dtype)
        convs = [mimi.encoder.get_submodule(n) for n in mimi.encoder._mimiconv1d_layer_names] + [mimi.downsample]
        self._pad = {"padding": [c.padding_total for c in convs], "modes": [c.pad_mode for c in convs], "channels": [c.in_channels for c in convs]}
        self.decode_window = decode_window
        self.dtype = dtype
        h, k = mc.hidden_size, self.codebooks
        self.enc_pad = [torch.zeros(0, c, p, dtype=dtype) for c, p in zip(self._pad["channels"], self._pad["padding"], strict=True)]
        self.dec_prev = torch.zeros(0, h, 1, dtype=dtype)  # the last frame's quantizer embedding
        self.dec_hist = torch.zeros(0, h, 2 * decode_window, dtype=dtype)  # decoder transformer output, 25 Hz
        self.text_prev = torch.zeros(0, dtype=torch.long)
        self.codes_prev = torch.zeros(0, k, dtype=torch.long)
        self.user_prev = torch.zeros(0, k, dtype=torch.long)
        self.frames = torch.zeros(0, dtype=torch.long)
        self.gens: list[torch.Generator] = []
        self.slots = 0
        self._grow(1)

    @classmethod
    def load(cls, model_dir: str) -> MoshiSteps:
        from transformers import MoshiForConditionalGeneration

        model = MoshiForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa").eval()
        return cls(model)

    def _apply(self, fn: Any, recurse: bool = True) -> MoshiSteps:
        """`Module.to(device, dtype)` (the torch engine's placement) moves the model and,
        with it, every slot's state: the rings, Mimi's stream caches, the last codes."""
        super()._apply(fn, recurse)
        if not hasattr(self, "lm_cache"):  # during __init__
            return self
        p = next(self.moshi.parameters())
        for c in (self.lm_cache, self.enc_cache, self.dec_cache):
            c.convert(fn, p.dtype, p.device)
        self.enc_pad = [fn(t) for t in self.enc_pad]
        for name in ("dec_prev", "dec_hist", "text_prev", "codes_prev", "user_prev", "frames"):
            setattr(self, name, fn(getattr(self, name)))
        if self.gens and self.gens[0].device != p.device:  # (each is seeded when its slot starts a conversation)
            self.gens = [torch.Generator(p.device) for _ in self.gens]
        self.dtype = p.dtype
        return self

    # ---- per-slot state ----------------------------------------------------------------
    def _grow(self, slots: int) -> None:
        if slots <= self.slots:
            return
        extra = slots - self.slots

        def more(t: torch.Tensor, fill: float) -> torch.Tensor:
            return torch.cat([t, torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])

        self.enc_pad = [more(t, 0) for t in self.enc_pad]
        self.dec_prev = more(self.dec_prev, 0)
        self.dec_hist = more(self.dec_hist, 0)
        self.text_prev = more(self.text_prev, self.text_bos)
        self.codes_prev = more(self.codes_prev, self.audio_bos)
        self.user_prev = more(self.user_prev, self.audio_bos)
        self.frames = more(self.frames, 0)
        for c in (self.lm_cache, self.enc_cache, self.dec_cache):
            c.grow(slots)
        self.gens += [torch.Generator(self.frames.device) for _ in range(extra)]
        self.slots = slots

    def _reset(self, rows: torch.Tensor, seeds: torch.Tensor) -> None:
        for s in self.enc_pad:
            s[rows] = 0
        self.dec_prev[rows] = 0
        self.dec_hist[rows] = 0
        self.text_prev[rows] = self.text_bos
        self.codes_prev[rows] = self.audio_bos
        self.user_prev[rows] = self.audio_bos
        self.frames[rows] = 0
        for c in (self.lm_cache, self.enc_cache, self.dec_cache):
            c.reset(rows)
        for r, seed in zip(rows.tolist(), seeds.tolist(), strict=True):
            self.gens[r].manual_seed(int(seed))

    def age(self, rows: torch.Tensor, frames: int) -> None:
        """Take the rows' conversations to `frames` frames along (their attention windows
        full once `frames` covers them; the state's values are left as they are): what
        the shapes bench does to time a long conversation's step without running it."""
        self.lm_cache.age(rows, frames)
        for c in (self.enc_cache, self.dec_cache):
            c.age(rows, 2 * frames)  # Mimi's transformers run at 25 Hz
        self.frames[rows] = frames

    # ---- the pieces of one step ------------------------------------------------------------
    @staticmethod
    def _transformer(layers: Any, x: torch.Tensor, cache: SlotCache, rows: torch.Tensor, rotary: Any = None) -> torch.Tensor:
        pos, mask = cache.begin(rows, x.shape[1])
        kw: dict[str, Any] = {"position_embeddings": rotary(x, pos)} if rotary is not None else {"position_ids": pos}
        for layer in layers:
            x = layer(x, attention_mask=mask, past_key_values=cache, **kw)[0]
        return x

    def encode(self, rows: torch.Tensor, pcm: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """Mimi's streaming encode of one frame per row: [B, 1920] -> codes [B, 8]."""
        mimi = self.moshi.audio_encoder
        pad = _RowPadding(self._pad, self.enc_pad, rows, fresh)
        emb = mimi.encoder(pcm[:, None, :].to(self.dtype), padding_cache=pad.cache)  # [B, H, 2]
        emb = self._transformer(mimi.encoder_transformer.layers, emb.transpose(1, 2), self.enc_cache, rows, mimi.encoder_transformer.rotary_emb)
        emb = mimi.downsample(emb.transpose(1, 2), padding_cache=pad.cache)  # [B, H, 1]
        for state, now in zip(self.enc_pad, pad.cache.padding_cache, strict=True):
            state[rows] = now
        codes: torch.Tensor = mimi.quantizer.encode(emb, self.codebooks).transpose(0, 1)  # [B, 8, 1]
        return codes[:, :, 0]

    def decode(self, rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """One frame of the model's codes per row [B, 8] -> [B, 1920] samples."""
        mimi = self.moshi.audio_encoder
        emb = mimi.quantizer.decode(codes[:, :, None])  # [B, H, 1]
        up = mimi.upsample(torch.cat([self.dec_prev[rows], emb], dim=2))[:, :, -2:]  # this frame's two 25 Hz positions
        self.dec_prev[rows] = emb
        y = self._transformer(mimi.decoder_transformer.layers, up.transpose(1, 2), self.dec_cache, rows, mimi.decoder_transformer.rotary_emb)
        hist = torch.cat([self.dec_hist[rows][:, :, 2:], y.transpose(1, 2)], dim=2)
        self.dec_hist[rows] = hist
        wav = mimi.decoder(hist)  # [B, 1, window * 1920]
        return wav[:, 0, -FRAME:]

    def _sample(self, logits: torch.Tensor, rows: list[int], temperature: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        """One token per row: argmax where the row's temperature is 0, else top-k sampling at
        its temperature from its slot's generator. The rows' temperatures and top-k filters
        are applied together (one host read of the settings a call, not one a row: on a GPU
        each would wait for the step so far); each sampled row then draws from its own
        generator."""
        out = logits.argmax(-1)
        temps, ks = temperature.tolist(), top_k.tolist()
        pick = [i for i, t in enumerate(temps) if t > 0]
        if not pick:
            return out
        vocab = logits.shape[-1]
        idx = torch.tensor(pick, device=logits.device)
        x = logits[idx].float() / torch.tensor([temps[i] for i in pick], dtype=torch.float32, device=logits.device)[:, None]
        k = [int(ks[i]) if 0 < int(ks[i]) < vocab else vocab for i in pick]
        if min(k) < vocab:
            kk = torch.tensor(k, device=x.device)[:, None]
            top = torch.topk(x, max(v for v in k if v < vocab)).values  # [n, the largest filter], descending
            kth = top.gather(1, kk.clamp(max=top.shape[1]) - 1)
            kth = torch.where(kk < vocab, kth, torch.full_like(kth, float("-inf")))  # rows without a filter keep every token
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, -1)
        drawn = torch.cat([torch.multinomial(probs[j], 1, generator=self.gens[rows[i]]) for j, i in enumerate(pick)])
        out[idx] = drawn
        return out

    def lm(self, rows: torch.Tensor, user: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The temporal transformer and the depth decoder for one frame per row: the
        text token [B] and the model's codes [B, 8] (delayed layout)."""
        m, k = self.moshi, self.codebooks
        first = self.frames[rows] == 0
        user_in = torch.cat([user[:, :1], self.user_prev[rows][:, 1:]], dim=1)  # acoustic codebooks: the frame before
        moshi_in = self.codes_prev[rows]
        emb = m.decoder.model.embed_tokens(self.text_prev[rows][:, None])
        for c in range(k):
            emb = emb + m.embed_tokens[c](moshi_in[:, c : c + 1]) + m.embed_tokens[k + c](user_in[:, c : c + 1])
        h = self._transformer(m.decoder.model.layers, emb, self.lm_cache, rows)
        h = m.decoder.model.norm(h)
        order = rows.tolist()
        text = self._sample(m.decoder.lm_head(h)[:, -1], order, p["text_temperature"], p["text_top_k"])
        from transformers import DynamicCache

        depth = m.depth_decoder
        cache = DynamicCache(config=depth.config)
        tok = text[:, None]
        codes = []
        for _ in range(k):
            logits = depth(input_ids=tok, last_hidden_state=h, past_key_values=cache, use_cache=True, return_dict=True).logits[:, -1]
            tok = self._sample(logits, order, p["audio_temperature"], p["audio_top_k"])[:, None]
            codes.append(tok[:, 0])
        out = torch.stack(codes, dim=1)
        out[:, 1:] = torch.where(first[:, None], torch.full_like(out[:, 1:], self.audio_bos), out[:, 1:])
        self.user_prev[rows] = user
        self.text_prev[rows] = text
        return text, out

    # ---- the op the engine runs ----------------------------------------------------------
    def step(self, slot: torch.Tensor, pcm: torch.Tensor, fresh: torch.Tensor, seed: torch.Tensor, **sampling: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = slot.long()
        self._grow(int(rows.max()) + 1)
        fresh = fresh.bool()
        if bool(fresh.any()):
            self._reset(rows[fresh], seed[fresh].long())
        user = self.encode(rows, pcm.float(), fresh)
        first = self.frames[rows] == 0
        text, codes = self.lm(rows, user, sampling)
        # the model's previous frame is complete now: codebook 0 from the last step, 1-7 from this one
        frame = torch.cat([self.codes_prev[rows][:, :1], codes[:, 1:]], dim=1)
        self.codes_prev[rows] = codes
        wav = torch.zeros(len(rows), FRAME, dtype=self.dtype, device=pcm.device)
        if bool((~first).any()):
            later = ~first
            wav[later] = self.decode(rows[later], frame[later]).to(self.dtype)
        self.frames[rows] += 1
        return {"pcm": wav.float(), "text": text, "codes": codes, "user_codes": user}
