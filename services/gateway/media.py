"""Images in, at the gateway: a chat's ``image_url`` parts as the image files the tokenizer reads.

A data URL (``data:image/png;base64,...``) is decoded here; an http(s) URL is fetched only from a
host ``--allowed-media-domains`` names (or a subdomain of one), within ``--max-image-bytes`` and
``--media-fetch-timeout``; anything else is a 400. ``--limit-images-per-prompt`` caps the images
of one request. Whether the bytes are an image, and whether the model takes images at all, the
tokenizer says (its processor decodes them), also as a 400.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp

from folio.core.input_processor import chat_image_urls, decode_data_url
from folio.shared.sampling import ParamError
from folio.services.gateway.protocol import ApiError


def allowed_host(host: str, domains: list[str]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (d.lower().strip().rstrip(".") for d in domains) if d)


async def fetch_image(url: str, index: int, config) -> bytes:
    parts = urlsplit(url)
    domains = [d for d in (config.allowed_media_domains or "").split(",") if d.strip()]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApiError(f"image {index}: expected a data URL (data:image/png;base64,...) or an http(s) URL",
                       param="messages")
    if not allowed_host(parts.hostname, domains):
        raise ApiError(f"image {index}: fetching images from {parts.hostname} is not allowed (this server fetches "
                       f"only from the hosts --allowed-media-domains names: {', '.join(domains) or 'none'})",
                       param="messages")
    limit = config.max_image_bytes
    timeout = aiohttp.ClientTimeout(total=config.media_fetch_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise ApiError(f"image {index}: {parts.hostname} answered HTTP {resp.status}", param="messages")
                data = await resp.content.read(limit + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ApiError(f"image {index}: could not fetch it from {parts.hostname}: {exc or type(exc).__name__}",
                       param="messages") from None
    if len(data) > limit:
        raise ApiError(f"image {index} is larger than the {limit} bytes allowed (--max-image-bytes)", param="messages")
    return data


async def chat_images(messages, config) -> list[bytes]:
    """The image files of a chat request's ``image_url`` parts, in order (ApiError: a 400)."""
    try:
        urls = chat_image_urls(messages)
    except ParamError as exc:
        raise ApiError(str(exc), param=exc.param) from None
    if not urls:
        return []
    if len(urls) > config.limit_images_per_prompt:
        raise ApiError(f"{len(urls)} images in one request; this server takes at most "
                       f"{config.limit_images_per_prompt} (--limit-images-per-prompt)", param="messages")
    out = []
    for i, url in enumerate(urls):
        if url.startswith("data:"):
            try:
                out.append(decode_data_url(url, config.max_image_bytes, i))
            except ParamError as exc:
                raise ApiError(str(exc), param=exc.param) from None
        else:
            out.append(await fetch_image(url, i, config))
    return out
