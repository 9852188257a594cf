"""Place image embeddings in a prompt: each image becomes a run of num_patches placeholder tokens.

The token ids go to the scheduler as usual; the embeds tensor (token embeddings with the image
rows overwritten) goes to ModelRunner as SeqStep.embeds. Placeholder ids are the same for every
image, so anything keyed by token ids (the prefix cache) must also key on `image_hashes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ImageSpan:
    offset: int  # first prompt position of the image
    length: int  # num_patches
    content_hash: str


@dataclass
class SplicedPrompt:
    token_ids: list[int]
    embeds: torch.Tensor | None  # [len(token_ids), hidden]; None for text-only prompts
    images: list[ImageSpan] = field(default_factory=list)

    @property
    def image_hashes(self) -> list[str]:
        return [span.content_hash for span in self.images]


def splice(segments: list[list[int] | tuple[torch.Tensor, str]], embed: nn.Embedding, placeholder_id: int) -> SplicedPrompt:
    """`segments` in prompt order: token id lists (text) or (embeddings [n, hidden], content hash) (images)."""
    ids: list[int] = []
    images: list[tuple[ImageSpan, torch.Tensor]] = []
    for seg in segments:
        if isinstance(seg, tuple):
            vectors, digest = seg
            if vectors.dim() != 2 or vectors.shape[1] != embed.embedding_dim:
                raise ValueError(f"image embeddings must be [n, {embed.embedding_dim}], got {list(vectors.shape)}")
            images.append((ImageSpan(len(ids), vectors.shape[0], digest), vectors))
            ids.extend([placeholder_id] * vectors.shape[0])
        else:
            ids.extend(seg)
    if not images:
        return SplicedPrompt(ids, None)
    with torch.no_grad():
        table = embed(torch.tensor(ids, dtype=torch.int64, device=embed.weight.device))
    for span, vectors in images:
        table[span.offset : span.offset + span.length] = vectors.to(table.dtype)
    return SplicedPrompt(ids, table, [span for span, _ in images])
