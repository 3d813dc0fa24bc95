"""Key/value cache layers for the HF engine's decoding: room reserved for the whole response up front.

transformers' ``DynamicLayer`` grows by concatenation, copying the layer's whole cache at every decoded token (the
copies are quadratic in the response length: 36% of a 64-token judge verdict's decoding on CPU, measured). A
``ReservedLayer`` holds buffers as long as the prompt and the longest response and writes each token into them; the
keys and values it returns are views of the filled part, the same numbers the concatenation returns.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import cache_utils


class ReservedLayer(cache_utils.DynamicLayer):
    """A full-attention layer whose keys and values live in buffers of ``room`` positions (more where a longer input
    comes: then twice what it holds); its keys and values are views of them. Tensors put in their place from outside
    (a prompt's cache repeated for its samples, rows selected) are copied into fresh buffers at the next update; a
    crop is a shorter view of the same buffers."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers of keys and values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if self.held is None or self.keys._base is not self.held[0] or self.held[0].shape[-2] < end:
            room = self.room if end <= self.room else max(end, 2 * length)  # past the room: doubling
            keys = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
            values = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
            if length:
                keys[..., :length, :] = self.keys
                values[..., :length, :] = self.values
            self.held = (keys, values)
        keys, values = self.held
        keys[..., length:end, :] = key_states
        values[..., length:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def reset(self) -> None:
        self.held = None
        super().reset()


def reserve(cache: Any, room: int) -> Any:
    """``cache`` (a ``DynamicCache``) with each plain full-attention layer made a ``ReservedLayer`` of ``room``
    positions; sliding-window, linear-attention and convolution layers stay as the model made them."""
    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if type(layer) is cache_utils.DynamicLayer and not layer.is_initialized:
            layers[i] = ReservedLayer(room)
    return cache
