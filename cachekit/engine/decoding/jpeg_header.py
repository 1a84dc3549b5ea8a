"""The header of a plain JPEG, read in a few microseconds: size, channels, EXIF orientation.

The ``"tensor"`` backend's fast path (:mod:`.decode_tensor`): Pillow's ``Image.open`` parses a
JPEG's markers in Python, a noticeable share of an image's CPU once torch does the rest.
:func:`read` reads only files whose every marker it understands and answers as Pillow
would; for anything else (Adobe, MPO or XMP segments, several EXIF segments, an orientation
stored oddly, arithmetic or lossless coding, more than 8 bits, a size above Pillow's
decompression-bomb limit) it returns None, and the caller opens the file with Pillow.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from PIL import Image

__all__ = ["Header", "read"]


class Header(NamedTuple):
    width: int
    height: int
    channels: int  # 1 (grayscale) or 3 (YCbCr or RGB, which libjpeg tells apart)
    orientation: int  # the EXIF tag as Pillow reads it; 1 when absent


_FRAMES = {0xC0, 0xC1, 0xC2}  # baseline, extended and progressive Huffman-coded frames
_TABLES = {0xC4, 0xDB, 0xDD, 0xFE} | set(range(0xE0, 0xF0))  # DHT, DQT, DRI, COM, APPn
_EXIF = b"Exif\x00\x00"
_ORIENTATION = 0x0112


def read(data: bytes) -> Optional[Header]:
    """The header of the JPEG ``data``, or None when Pillow should read it (see the module)."""
    view = memoryview(data)
    if view[:3] != b"\xff\xd8\xff":
        return None
    at, size, frame, orientation = 2, len(view), None, 1
    exif_seen = False
    while at + 4 <= size:
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
            continue
        length = (view[at + 2] << 8) | view[at + 3]
        body = view[at + 4:at + 2 + length]
        if length < 2 or len(body) != length - 2:
            return None
        if marker in _FRAMES:
            if frame is not None or len(body) < 6 or body[0] != 8:
                return None
            frame = ((body[3] << 8) | body[4], (body[1] << 8) | body[2], body[5])
        elif marker == 0xDA:  # start of scan: Pillow reads no marker after it
            break
        elif marker not in _TABLES:
            return None
        elif marker == 0xE1 and body[:6] == _EXIF:
            found = None if exif_seen else _exif_orientation(body[6:])
            if found is None:
                return None
            exif_seen, orientation = True, found
        elif (marker == 0xE1 or marker == 0xEE  # XMP and others; Adobe (colour transform)
              or (marker == 0xE2 and body[:4] == b"MPF\x00")):  # MPO: Pillow's own format
            return None
        at += 2 + length
    else:
        return None
    if frame is None:
        return None
    width, height, channels = frame
    limit = Image.MAX_IMAGE_PIXELS
    if width < 1 or height < 1 or channels not in (1, 3) or (
            limit is not None and width * height > limit):
        return None
    return Header(width, height, channels, orientation)


def _exif_orientation(tiff: memoryview) -> Optional[int]:
    """The orientation in the first IFD of the TIFF structure ``tiff``: 1 when there is none,
    None when it is not one SHORT or the structure is not plain."""
    if len(tiff) < 8 or tiff[:4] not in (b"II*\x00", b"MM\x00*"):
        return None
    order = "little" if tiff[0] == 0x49 else "big"

    def number(at: int, width: int) -> int:
        return int.from_bytes(tiff[at:at + width], order)

    first = number(4, 4)
    if first + 2 > len(tiff):
        return None
    entries = number(first, 2)
    if first + 2 + 12 * entries > len(tiff):
        return None
    found = []
    for index in range(entries):
        entry = first + 2 + 12 * index
        if number(entry, 2) == _ORIENTATION:
            if number(entry + 2, 2) != 3 or number(entry + 4, 4) != 1:  # one SHORT
                return None
            found.append(number(entry + 8, 2))
    if len(found) > 1:
        return None
    return found[0] if found else 1
