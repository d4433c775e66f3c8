"""Chat requests that carry images (--random-mm-base-items-per-request): generated random-pixel JPEGs or the files
of a folder, sent as OpenAI `image_url` content parts with base64 data URLs, and the image tokens the server counted.

Generated images follow `vllm bench serve --dataset-name random-mm` (vLLM 0.32.0,
vllm/benchmarks/datasets/datasets.py `generate_synthetic_image` and `transform_image`): i.i.d. RGB pixels, JPEG,
`data:image/jpeg;base64,...`. They are encoded before the run, so that no request's TTFT holds the client's
encoding; each request's images are distinct up to MAX_POOL_BYTES of them, after which they repeat (and a server's
multimodal cache may serve a repeat without preprocessing it: the result says how many were distinct).

Image tokens: a server counts them inside `usage.prompt_tokens`. After the run one text-only request (request 0's
messages without their images, max_tokens 1) gives what the server counts for that text wrapped in its chat
template; a request's image tokens are its prompt tokens less that count, moved by the difference between its
text's tokens and request 0's by our tokenizer. Without our tokenizer's counts or the server's usage they are
unknown, and the result says why.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infertrace.input_files import InputFileError, read_bytes
from infertrace.load.workloads.dataset import DatasetError

MAX_POOL_BYTES = 256 << 20  # encoded images kept for a run; past this they repeat
MAX_IMAGE_BYTES = 64 << 20  # one --image-dir file
MAX_DIR_FILES = 10_000
JPEG_QUALITY = 90
IMAGE_MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "GIF": "image/gif", "WEBP": "image/webp", "BMP": "image/bmp"}


class ImageError(DatasetError):
    """A --image-dir file that is no image, or a folder without images: one line for the user."""


@dataclass(slots=True)
class ImagePlan:
    """Each request's `per_request` images, cycled from `urls` (data URLs) by the request's index."""

    per_request: int
    urls: list[str]
    source: str  # "generated WxH" or the folder

    def urls_of(self, index: int) -> list[str]:
        n = len(self.urls)
        return [self.urls[(index * self.per_request + k) % n] for k in range(self.per_request)]

    def messages(self, messages: list[dict], index: int) -> list[dict]:
        """The chat's last user message with this request's images before its text (as vLLM's random-mm does)."""
        last = messages[-1]
        text = last.get("content")
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in self.urls_of(index)]
        if isinstance(text, str):
            parts.append({"type": "text", "text": text})
        elif isinstance(text, list):
            parts.extend(text)
        return [*messages[:-1], {**last, "content": parts}]


def plan_of(cfg) -> ImagePlan:
    """The run's images: --image-dir's files, or generated ones for --num-prompts requests from --seed."""
    if cfg.image_dir is not None:
        return folder_plan(cfg.images, cfg.image_dir)
    return generated_plan(cfg.images, cfg.image_size, cfg.num_prompts, cfg.seed)


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def generated_plan(per_request: int, size: tuple[int, int], requests: int, seed: int) -> ImagePlan:
    """Distinct random-pixel JPEGs for `requests` requests, as many as MAX_POOL_BYTES holds (at least one)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = size
    urls: list[str] = []
    total = 0
    for _ in range(max(1, requests * per_request)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            buf, format="JPEG", quality=JPEG_QUALITY)
        url = data_url("image/jpeg", buf.getvalue())
        if urls and total + len(url) > MAX_POOL_BYTES:
            break
        urls.append(url)
        total += len(url)
    return ImagePlan(per_request, urls, f"generated {width}x{height}")


def folder_plan(per_request: int, folder: str | Path) -> ImagePlan:
    """The image files of `folder` (by name, hidden files left out), each checked to open as an image."""
    from PIL import Image, UnidentifiedImageError

    root = Path(folder)
    if not root.is_dir():
        raise ImageError(f"--image-dir {root}: not a folder")
    files = sorted(p for p in root.iterdir() if not p.name.startswith(".") and not p.is_dir())
    if not files:
        raise ImageError(f"--image-dir {root}: no files in it")
    if len(files) > MAX_DIR_FILES:
        raise ImageError(f"--image-dir {root}: {len(files)} files, above the {MAX_DIR_FILES} a run reads")
    urls, total = [], 0
    for path in files:
        try:
            data = read_bytes(path, MAX_IMAGE_BYTES)
        except InputFileError as e:
            raise ImageError(f"cannot read {path}: {e}") from None
        try:
            with Image.open(io.BytesIO(data)) as im:
                kind = im.format
                im.verify()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"{path} is not an image Pillow can read ({e})") from None
        if kind not in IMAGE_MIME:
            raise ImageError(f"{path} is a {kind} image; servers take {', '.join(IMAGE_MIME)}")
        total += len(data)
        if total > MAX_POOL_BYTES:
            raise ImageError(f"--image-dir {root}: its images pass {MAX_POOL_BYTES >> 20} MiB; use fewer")
        urls.append(data_url(IMAGE_MIME[kind], data))
    return ImagePlan(per_request, urls, str(root))
