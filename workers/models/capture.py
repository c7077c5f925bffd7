"""Forward pre-hooks that capture the residual stream at chosen layer ids during a forward.

Each id is the input of one module (layer i, or the final norm for id N; see adapters.py),
so one pre-hook per id suffices and the model's own forward runs untouched. Only the
requested ids are kept, unlike output_hidden_states, which keeps every layer.

Two ways to receive them:
- `into(buffer)`: each stream is copied into buffer[:, :, k] the moment the forward passes
  it ([batch, seq, n_ids, hidden], any device, any dtype), so nothing outlives its layer and
  no stacking copy follows. With a pinned host buffer the copies from a GPU run
  asynchronously, in stream order, while the next layers compute. This is what the stage uses.
- otherwise `take()` returns references to the streams themselves (for tests and tools).
"""

from __future__ import annotations

from typing import Any

from eyas.workers.models.adapters import HF_TAP, Decoder, StreamTap


class LayerCapture:
    """`with LayerCapture(decoder, ids) as cap: cap.into(buf); decoder.module(...); cap.finish()`."""

    def __init__(self, decoder: Decoder, layer_ids, tap: StreamTap = HF_TAP):
        self.decoder = decoder
        self.layer_ids = decoder.check_ids(layer_ids)
        self.tap = tap
        self._handles: list[Any] = []
        self._seen: dict[int, Any] = {}
        self._buffer: Any = None

    def __enter__(self) -> LayerCapture:
        for k, layer_id in enumerate(self.layer_ids):
            module = self.decoder.tap_module(layer_id)
            self._handles.append(module.register_forward_pre_hook(self._hook(k, layer_id), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    def _hook(self, k: int, layer_id: int):
        read = self.tap.read

        def hook(module, args, kwargs):
            stream = read(args, kwargs)
            if self._buffer is not None:
                self._buffer[:, :, k].copy_(stream, non_blocking=True)
                self._seen[layer_id] = True
            else:
                self._seen[layer_id] = stream
            return None

        return hook

    def into(self, buffer: Any) -> None:
        """Copy the next forward's streams into `buffer` [batch, seq, n_ids, hidden]."""
        self._seen.clear()
        self._buffer = buffer

    def finish(self) -> Any:
        """The filled buffer, after checking that the forward reached every id."""
        self._check()
        buffer, self._buffer = self._buffer, None
        self._seen.clear()
        return buffer

    def take(self) -> list[Any]:
        """The captured streams in `layer_ids` order ([batch, seq, hidden] each); then forget them."""
        self._check()
        out = [self._seen[i] for i in self.layer_ids]
        self._seen.clear()
        return out

    def clear(self) -> None:
        """Forget a forward that did not finish (e.g. it ran out of memory)."""
        self._seen.clear()
        self._buffer = None

    def _check(self) -> None:
        missing = [i for i in self.layer_ids if i not in self._seen]
        if missing:
            raise RuntimeError(
                f"layer ids {missing} were not reached by the forward; the decoder did not run the tapped modules"
            )
