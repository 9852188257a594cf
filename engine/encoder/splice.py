"""Place image embeddings in a prompt: each image becomes a run of num_patches placeholder tokens.

The token ids go to the scheduler as usual; the embeds tensor (token embeddings with the image
rows overwritten) goes to ModelRunner as SeqStep.embeds. Placeholder ids are the same for every
image, so anything keyed by token ids (the prefix cache) must also key on `image_hashes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import base64

import torch
from torch import nn

from engine.encoder.prompt import EncodedImage, ImageSpan, PromptImage


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


def image_tensor(image: EncodedImage) -> torch.Tensor:
    """The embeddings an EncodedImage carries, as a float32 [num_patches, hidden] tensor."""
    raw = base64.b64decode(image.data)
    n, hidden = image.shape
    if len(raw) != n * hidden * 4:
        raise ValueError(f"image {image.hash[:12]}: {len(raw)} bytes of data for shape [{n}, {hidden}] float32")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(n, hidden)


def spliced_prompt(prompt: list[int], images: list[PromptImage], embed: nn.Embedding) -> SplicedPrompt:
    """The prompt's embeddings with the image rows in place; ValueError when they do not fit `prompt`."""
    segments: list = []
    at = 0
    for placed in sorted(images, key=lambda p: p.offset):
        vectors = image_tensor(placed.image)
        end = placed.offset + vectors.shape[0]
        if placed.offset < at or end > len(prompt):
            raise ValueError(f"image at prompt position {placed.offset} (+{vectors.shape[0]}) overlaps another "
                             f"or runs past the prompt ({len(prompt)} tokens)")
        segments.append(prompt[at : placed.offset])
        segments.append((vectors, placed.image.hash))
        at = end
    segments.append(prompt[at:])
    out = splice(segments, embed, 0)
    out.token_ids = list(prompt)  # the caller's placeholder ids stay: they name the blocks
    return out


def step_embeds(spliced: SplicedPrompt, embed: nn.Embedding, start: int, tokens: list[int]) -> torch.Tensor | None:
    """Embedding rows for tokens at positions [start, start + len(tokens)), or None when no image is in there."""
    end = start + len(tokens)
    if not any(s.offset < end and start < s.offset + s.length for s in spliced.images):
        return None
    rows = spliced.embeds[start:end]
    if rows.shape[0] < len(tokens):  # a recompute chunk running past the prompt into generated tokens
        tail = torch.tensor(tokens[rows.shape[0]:], dtype=torch.int64, device=embed.weight.device)
        with torch.no_grad():
            rows = torch.cat([rows, embed(tail).to(rows.dtype)])
    return rows
