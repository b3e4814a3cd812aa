"""Preview images of arrays for the web pages: a 2-D slice (or a whole 1-D array) read within a
bound, reduced to at most a given number of pixels, coloured, and encoded as a PNG.

What is read. A slice of ``H x W`` elements is read whole when the chunks it touches hold at
most ``max_source`` elements, and reduced by block means (every pixel the mean of a ``b x b``
block), which is faithful to the data. A larger slice is read *strided* (every ``s``-th element
along both image axes), with the smallest ``s`` that keeps the chunks touched within the bound:
once ``s`` reaches the chunk length, a stride skips whole chunks, so any slice of any size gets a
preview at a bounded cost, sampled rather than averaged, and the page says so. Refusing large
slices instead would leave exactly the arrays people most want to glance at without a picture.
The one refusal (:class:`PreviewTooLarge`, a 413) is a slice whose every element lies in a chunk
larger than the bound: no stride avoids decoding it. A slice may be narrowed to a window of
each image dimension (:class:`Selection`), which is how the pages zoom: a sampled overview, then
regions small enough to be read whole.

What it looks like. Values map linearly from the minimum to the maximum of the finite values
read onto :data:`LEVELS` colours of a perceptual colormap (:data:`COLORMAP`, dark blue-violet to
yellow, lightness rising evenly); a value ``v`` gets level ``min(LEVELS - 1, floor((v - vmin) /
(vmax - vmin) * LEVELS))`` (a constant slice: the middle level; ``±inf`` the ends). NaN is drawn
grey (:data:`NAN_RGB`) and, when ``mark_fill`` is on, elements equal to the array's fill value
pale rose (:data:`FILL_RGB`), both left out of the minimum and maximum (the fill value is what
a never-written chunk reads as; whether it is marked unless the page asks otherwise:
:func:`marks_fill_by_default`). A block of a reduced image is the mean of its other elements;
one with none is NaN if it holds a NaN, else fill. A 1-D array is drawn as a line, each of
:data:`LINE_WIDTH` columns spanning the range of the values it covers. Bool, integer and float
arrays only.

The PNG is palette-indexed (one byte a pixel) and written with numpy and zlib alone.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zarrlake.serve.errors import BadRequest, HTTPError
from zarrlake.serve.params import whole_number

__all__ = [
    "COLORMAP",
    "FILL_RGB",
    "LEVELS",
    "LINE_HEIGHT",
    "LINE_RGB",
    "LINE_WIDTH",
    "MIN_WINDOW",
    "NAN_RGB",
    "PALETTE",
    "Preview",
    "PreviewTooLarge",
    "PreviewUnsupported",
    "ReadPlan",
    "Selection",
    "colorbar_png",
    "encode_png",
    "marks_fill_by_default",
    "plan_read",
    "previewable",
    "render",
]

# -- the colours ---------------------------------------------------------------------------------

#: Colours of the colormap; palette indices 0 .. LEVELS - 1 of every preview.
LEVELS = 252
NAN_INDEX, FILL_INDEX, BACKGROUND_INDEX, LINE_INDEX = 252, 253, 254, 255
NAN_RGB = (176, 176, 176)
FILL_RGB = (242, 196, 206)
BACKGROUND_RGB = (255, 255, 255)
#: The 1-D line's colour: the colormap's blue, dark enough on white.
LINE_RGB = (40, 90, 140)


def _oklab_to_srgb(lab: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """sRGB in [0, 1] (unclipped) of Oklab colours (``(..., 3)``), after Björn Ottosson's
    published matrices."""
    lightness, a, b = lab[..., 0], lab[..., 1], lab[..., 2]
    l_ = lightness + 0.3963377774 * a + 0.2158037573 * b
    m_ = lightness - 0.1055613458 * a - 0.0638541728 * b
    s_ = lightness - 0.0894841775 * a - 1.2914855480 * b
    lms = np.stack([l_**3, m_**3, s_**3], axis=-1)
    to_rgb = np.array(
        [
            [4.0767416621, -3.3077115913, 0.2309699292],
            [-1.2684380046, 2.6097574011, -0.3413193965],
            [-0.0041960863, -0.7034186147, 1.7076147010],
        ]
    )
    linear = lms @ to_rgb.T
    magnitude = np.abs(linear)
    encoded = np.where(
        magnitude <= 0.0031308, 12.92 * magnitude, 1.055 * magnitude ** (1 / 2.4) - 0.055
    )
    return np.asarray(np.sign(linear) * encoded)


def _colormap(levels: int) -> npt.NDArray[np.uint8]:
    """A viridis-like colormap of our own: a path through Oklab whose lightness rises linearly
    from 0.30 to 0.92 while the hue turns from violet (315°) through blue and teal to yellow
    (105°), with chroma high at the ends and lower in the middle (as viridis has it). A colour
    outside sRGB has its chroma reduced until it fits, so lightness stays exactly linear: equal
    steps of value read as equal steps of brightness, in colour and in greyscale print."""
    t = np.linspace(0.0, 1.0, levels)
    lightness = 0.30 + 0.62 * t
    hue = np.radians(315.0 - 210.0 * t)
    chroma = 0.31 * t**2 - 0.265 * t + 0.145
    rgb = np.zeros((levels, 3))
    for i in range(levels):
        c = chroma[i]
        for _ in range(40):
            lab = np.array([lightness[i], c * math.cos(hue[i]), c * math.sin(hue[i])])
            rgb[i] = _oklab_to_srgb(lab)
            if rgb[i].min() >= 0.0 and rgb[i].max() <= 1.0:
                break
            c *= 0.97
    return np.asarray(np.clip(np.round(rgb * 255), 0, 255).astype(np.uint8))


#: ``(LEVELS, 3)`` uint8 RGB, darkest first.
COLORMAP = _colormap(LEVELS)
#: The palette of every preview PNG: the colormap, then NaN, fill, background and line.
PALETTE = np.concatenate(
    [COLORMAP, np.array([NAN_RGB, FILL_RGB, BACKGROUND_RGB, LINE_RGB], dtype=np.uint8)]
)

# -- PNG -----------------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(
    indices: npt.NDArray[np.uint8],
    palette: npt.NDArray[np.uint8],
    text: Mapping[str, str] | None = None,
    *,
    level: int = 6,
) -> bytes:
    """A palette PNG (colour type 3, 8 bits) of ``indices`` (``(height, width)`` uint8) with the
    ``(n, 3)`` uint8 RGB ``palette`` (n ≤ 256) and ``tEXt`` chunks ``text`` (Latin-1 keys of 1 to
    79 characters; values are encoded as Latin-1 with anything else replaced). Rows are stored
    unfiltered: a colormapped image compresses well without filters and this is faster."""
    height, width = indices.shape
    if not (0 < len(palette) <= 256) or width == 0 or height == 0:
        raise ValueError("a PNG needs a palette of 1 to 256 colours and at least one pixel")
    raw = np.empty((height, width + 1), dtype=np.uint8)
    raw[:, 0] = 0  # filter type "None" for every row
    raw[:, 1:] = indices
    header = struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)
    parts = [b"\x89PNG\r\n\x1a\n", _chunk(b"IHDR", header)]
    parts.append(_chunk(b"PLTE", np.ascontiguousarray(palette, dtype=np.uint8).tobytes()))
    for key, value in (text or {}).items():
        payload = key.encode("latin-1") + b"\0" + value.encode("latin-1", "replace")
        parts.append(_chunk(b"tEXt", payload))
    parts.append(_chunk(b"IDAT", zlib.compress(raw.tobytes(), level)))
    parts.append(_chunk(b"IEND", b""))
    return b"".join(parts)


def colorbar_png(width: int = LEVELS, height: int = 1) -> bytes:
    """The colour bar: the colormap left (minimum) to right (maximum), ``width x height``
    pixels (the page stretches it)."""
    columns = np.minimum((np.arange(width) * LEVELS) // width, LEVELS - 1).astype(np.uint8)
    return encode_png(np.tile(columns, (height, 1)), COLORMAP)


# -- what to draw --------------------------------------------------------------------------------


class PreviewTooLarge(HTTPError):
    """No stride keeps the chunks a preview would decode within the bound (413)."""

    status = 413


class PreviewUnsupported(HTTPError):
    """An array with no preview: not bool, integer or float, or 0-dimensional (422)."""

    status = 422


#: numpy kinds a preview draws: bool, signed and unsigned integers, floats.
_KINDS = "biuf"
#: Zarr v3 ``data_type`` names of those kinds (what :func:`previewable` reads from metadata).
_DATA_TYPES = frozenset(
    ["bool", "float16", "float32", "float64"]
    + [f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)]
)


def previewable(data_type: object, shape: list[int] | tuple[int, ...]) -> str | None:
    """Why an array of Zarr ``data_type`` and ``shape`` has no preview, or None when it has."""
    if not isinstance(data_type, str) or data_type not in _DATA_TYPES:
        shown = data_type if isinstance(data_type, str) else "this data type"
        return f"no preview for data type {shown!r} (bool, integer and float arrays only)"
    if len(shape) == 0:
        return "a 0-dimensional array has no preview"
    if 0 in shape:
        return "the array is empty"
    return None


def marks_fill_by_default(fill_value: object, attributes: Mapping[str, Any] | None = None) -> bool:
    """Whether a preview marks the elements equal to an array's fill value (its Zarr metadata
    ``fill_value``) unless asked otherwise: when that is a sentinel someone chose (-9999, 1e20),
    or the attributes declare one (CF's ``_FillValue`` or ``missing_value``); not for Zarr's
    default zero or false, which is as often real data (rain, counts, masks) and which xarray,
    too, reads from a Zarr v3 array as data. A NaN fill needs no marking: NaN is drawn as NaN."""
    if attributes and ("_FillValue" in attributes or "missing_value" in attributes):
        return True
    if isinstance(fill_value, bool) or fill_value is None:
        return bool(fill_value)
    if isinstance(fill_value, int | float):
        return fill_value != 0 and not math.isnan(fill_value)
    return fill_value in ("Infinity", "-Infinity")


#: A zoomed window is never narrower than this many elements (unless the dimension is).
MIN_WINDOW = 8


@dataclass(frozen=True)
class Selection:
    """Which elements a preview shows: dimension ``y`` down and dimension ``x`` across (``y``
    None for a 1-D array), every other dimension ``d`` at ``index[d]`` (entries of ``y`` and
    ``x`` are 0), the ``windows`` of the image dimensions (``(d, start, stop)``, half-open,
    sorted by ``d``; a dimension without one is shown whole), and whether fill-value elements
    are marked (:func:`render`).

    A window belongs to a dimension, not to the image's rows or columns, so a window survives
    a change of the other dimensions' indices and of which dimension is drawn across."""

    y: int | None
    x: int
    index: tuple[int, ...]
    mark_fill: bool = True
    windows: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def default(cls, shape: tuple[int, ...], *, mark_fill: bool = True) -> Selection:
        """The last two dimensions (the last one of a 1-D array), the others at 0, whole."""
        ndim = len(shape)
        y = ndim - 2 if ndim >= 2 else None
        return cls(y, ndim - 1, (0,) * ndim, mark_fill)

    @classmethod
    def parse(
        cls,
        shape: tuple[int, ...],
        params: Mapping[str, str],
        *,
        names: list[str] | None = None,
        mark_fill_default: bool = True,
    ) -> Selection:
        """The selection of query ``params`` for an array of ``shape``: ``y`` and ``x``
        (dimension numbers), ``i<d>`` (the index of dimension ``d``), ``w<d>`` (a window of an
        image dimension, ``start:stop``, either end left out for the array's), ``fill``
        (``mark`` or ``data``); each absent one as in :meth:`default`, and the ``i`` and ``w``
        of dimensions that do not need them ignored. ``names`` (the dimension names) make the
        messages clearer. Raises :class:`~zarrlake.serve.errors.BadRequest` naming the
        parameter that is not a number, out of range, or repeats ``y`` as ``x``."""
        ndim = len(shape)
        default = cls.default(shape, mark_fill=mark_fill_default)

        def label(d: int) -> str:
            name = names[d] if names and d < len(names) and names[d] else None
            return f"dimension {d} ({name!r})" if name else f"dimension {d}"

        def integer(key: str) -> int | None:
            raw = params.get(key)
            return None if raw is None or raw == "" else whole_number(key, raw, signed=True)

        def dim(key: str, fallback: int | None) -> int | None:
            value = integer(key)
            if value is None:
                return fallback
            if not 0 <= value < ndim:
                raise BadRequest(f"{key}={value}: the array has dimensions 0 to {ndim - 1} only")
            return value

        x = dim("x", default.x)
        assert x is not None
        y = None if ndim < 2 else dim("y", default.y)
        if y is not None and y == x:
            # One of them given, onto the other's default: the other takes its place.
            given_x, given_y = bool(params.get("x")), bool(params.get("y"))
            if given_x and not given_y:
                y = default.x
            elif given_y and not given_x:
                x = default.y
                assert x is not None
            else:
                raise BadRequest(f"y and x are both {label(x)}: choose two dimensions")
        index = []
        for d in range(ndim):
            value = None if d in (x, y) else integer(f"i{d}")
            if value is None:
                index.append(0)
                continue
            if not 0 <= value < shape[d]:
                raise BadRequest(f"i{d}={value} is out of range for {label(d)} of size {shape[d]}")
            index.append(value)
        windows = []
        for d in sorted(a for a in (y, x) if a is not None):
            raw = params.get(f"w{d}")
            if not raw:
                continue
            first, colon, second = raw.partition(":")
            if not colon:
                raise BadRequest(f"w{d} must be start:stop, not {raw[:40]!r}")
            start = whole_number(f"w{d}", first, signed=True) if first.strip() else 0
            stop = whole_number(f"w{d}", second, signed=True) if second.strip() else shape[d]
            if not 0 <= start < stop <= shape[d]:
                raise BadRequest(
                    f"w{d}={start}:{stop} is not a window of {label(d)} of size {shape[d]}"
                )
            if (start, stop) != (0, shape[d]):
                windows.append((d, start, stop))
        fill = params.get("fill")
        if fill not in (None, "", "mark", "data"):
            raise BadRequest(f"fill must be 'mark' or 'data', not {fill[:40]!r}")
        mark_fill = mark_fill_default if not fill else fill == "mark"
        return cls(y, x, tuple(index), mark_fill, tuple(windows))

    def span(self, d: int, size: int) -> tuple[int, int]:
        """(start, stop) of dimension ``d`` (of ``size`` elements) in the image."""
        for dim, start, stop in self.windows:
            if dim == d:
                return start, stop
        return 0, size

    def query(self) -> dict[str, str]:
        """The query parameters that :meth:`parse` reads back as this selection."""
        out = {"x": str(self.x)}
        if self.y is not None:
            out["y"] = str(self.y)
        for d, i in enumerate(self.index):
            if d not in (self.x, self.y):
                out[f"i{d}"] = str(i)
        for d, start, stop in self.windows:
            out[f"w{d}"] = f"{start}:{stop}"
        out["fill"] = "mark" if self.mark_fill else "data"
        return out

    def with_windows(
        self, shape: tuple[int, ...], spans: Mapping[int, tuple[int, int]]
    ) -> Selection:
        """This selection with the image dimensions in ``spans`` (``d -> (start, stop)``) shown
        from start to stop (a whole dimension: no window)."""
        kept = {d: (a, b) for d, a, b in self.windows}
        kept.update(spans)
        windows = tuple((d, a, b) for d, (a, b) in sorted(kept.items()) if (a, b) != (0, shape[d]))
        return Selection(self.y, self.x, self.index, self.mark_fill, windows)

    def zoomed(
        self, shape: tuple[int, ...], centre: Mapping[int, float], factor: float
    ) -> Selection:
        """The selection ``factor`` times closer (< 1: farther) around ``centre`` (``d ->`` the
        element at the middle) in each image dimension given; a window at least
        :data:`MIN_WINDOW` wide and within the array."""
        spans = {}
        for d, middle in centre.items():
            start, stop = self.span(d, shape[d])
            width = min(shape[d], max(MIN_WINDOW, round((stop - start) / factor)))
            first = round(middle - width / 2)
            first = max(0, min(first, shape[d] - width))
            spans[d] = (first, first + width)
        return self.with_windows(shape, spans)


@dataclass(frozen=True)
class ReadPlan:
    """How a preview reads its slice: every ``step``-th element along the image axes, then means
    of ``block``-wide blocks (``block x block`` for 2-D). ``source_shape``: the slice
    (``(H, W)`` or ``(n,)``); ``read_shape``: the elements read; ``out_shape``: the blocks;
    ``decoded``: the elements of the chunks the read touches."""

    step: int
    block: int
    source_shape: tuple[int, ...]
    read_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    decoded: int

    @property
    def sampled(self) -> bool:
        return self.step > 1


#: Strides :func:`plan_read` tries one by one before it bisects.
_SCAN = 4096


def _chunks_touched(n: int, chunk: int, step: int, start: int = 0) -> int:
    """Chunks of length ``chunk`` that the ``n`` indices ``start, start + step, …`` fall in."""
    if step >= chunk:
        return -(-n // step)  # one chunk each
    last = start + (n - 1) // step * step
    return last // chunk - start // chunk + 1  # every chunk from the first to the last


def plan_read(
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    selection: Selection,
    *,
    max_pixels: int,
    max_source: int,
    max_width: int | None = None,
) -> ReadPlan:
    """The read and reduction of ``selection`` in an array of ``shape`` and (inner) ``chunks``:
    the smallest stride whose chunks touched hold at most ``max_source`` elements (counted whole:
    decoding them is the cost), then the smallest block whose output has at most ``max_pixels``
    pixels (a 1-D line: at most ``max_width`` columns). Raises :class:`PreviewTooLarge`."""
    axes = [d for d in (selection.y, selection.x) if d is not None]
    spans = [selection.span(d, shape[d]) for d in axes]
    source = tuple(stop - start for start, stop in spans)
    per_chunk = math.prod(chunks)
    if per_chunk > max_source:
        raise PreviewTooLarge(
            f"a chunk of this array holds {per_chunk:,} elements, more than a preview reads "
            f"({max_source:,})"
        )

    def decoded(step: int) -> int:
        return per_chunk * math.prod(
            _chunks_touched(n, chunks[d], step, start)
            for d, n, (start, _) in zip(axes, source, spans, strict=True)
        )

    def read(step: int) -> int:
        return math.prod(-(-n // step) for n in source)

    def fits(step: int) -> bool:
        return decoded(step) <= max_source and read(step) <= max_source

    step = 1
    if not fits(1):
        # Below the longest chunk a stride may not skip chunks and what it decodes does not fall
        # steadily: try each (up to _SCAN, which covers the chunks of nearly every array);
        # beyond, it falls with the stride, so bisect (a stride that fits is sure: one element
        # an axis decodes one chunk).
        longest = max(chunks[d] for d in axes)
        scanned = min(longest, _SCAN)
        found = next((s for s in range(2, scanned) if fits(s)), None)
        if found is None:
            low, high = scanned, max(max(source), longest)
            while low < high:
                mid = (low + high) // 2
                if fits(mid):
                    high = mid
                else:
                    low = mid + 1
            found = low
        step = found
    read_shape = tuple(-(-n // step) for n in source)
    if len(read_shape) == 1:
        # A line has a fixed width: its columns cover fractions of the elements (see _envelope).
        columns = max(1, min(max_width or LINE_WIDTH, max_pixels // LINE_HEIGHT))
        block = max(1, -(-read_shape[0] // columns))
        return ReadPlan(step, block, source, read_shape, (columns,), decoded(step))
    else:
        h, w = read_shape
        block = max(1, math.isqrt(max(0, h * w // max_pixels - 1)))
        while -(-h // block) * -(-w // block) > max_pixels:
            block += 1
    out_shape = tuple(-(-n // block) for n in read_shape)
    return ReadPlan(step, block, source, read_shape, out_shape, decoded(step))


# -- rendering -----------------------------------------------------------------------------------

#: Height of a 1-D array's line image; its width is at most :data:`LINE_WIDTH` columns.
LINE_HEIGHT = 180
LINE_WIDTH = 960
_LINE_MARGIN = 6
#: Rows of blocks reduced at a time (bounds the temporaries of a large slice).
_BAND_ELEMENTS = 4 * 1024 * 1024


@dataclass(frozen=True)
class Preview:
    """A rendered preview: the ``png``, its ``width`` and ``height`` in pixels, the range of the
    finite values read (``vmin``, ``vmax``; None when there are none), pixels drawn as NaN and as
    fill, the ``plan``, and ``kind`` (``"image"``: 2-D, ``"line"``: 1-D)."""

    png: bytes
    width: int
    height: int
    vmin: float | None
    vmax: float | None
    nan_pixels: int
    fill_pixels: int
    plan: ReadPlan
    kind: str


@dataclass
class _Reduced:
    """Per block (a line: per column): the mean of its values (a line: also their ``low`` and
    ``high``), which blocks hold nothing but NaN (``nan``) or the fill value (``fill``), and the
    range of the finite values (None when there are none)."""

    mean: npt.NDArray[np.floating[Any]]
    low: npt.NDArray[np.floating[Any]] | None
    high: npt.NDArray[np.floating[Any]] | None
    nan: npt.NDArray[np.bool_]
    fill: npt.NDArray[np.bool_]
    vmin: float | None
    vmax: float | None


def _as_float(values: npt.NDArray[Any]) -> npt.NDArray[np.floating[Any]]:
    """The values as floats: float32 where that is exact (small integers, bool, float16/32)."""
    if values.dtype.kind == "f" and values.dtype.itemsize >= 4:
        return values
    if values.dtype.itemsize <= 2 or values.dtype.kind == "b":
        return values.astype(np.float32)
    return values.astype(np.float64)


def _marks_fill(fill_value: Any, mark_fill: bool) -> bool:
    """Whether elements equal to ``fill_value`` are told apart (a NaN fill is NaN already)."""
    if not mark_fill or fill_value is None:
        return False
    return not (isinstance(fill_value, float | np.floating) and math.isnan(fill_value))


def _bands(rows: int, row_elements: int, block: int) -> Iterator[tuple[int, int]]:
    """Row ranges of whole blocks, each about :data:`_BAND_ELEMENTS` elements."""
    per_band = max(block, (_BAND_ELEMENTS // max(1, row_elements)) // block * block)
    for start in range(0, rows, per_band):
        yield start, min(rows, start + per_band)


def _blocks(a: npt.NDArray[Any], band: tuple[int, int], block: int, pad: Any) -> npt.NDArray[Any]:
    """``a`` padded with ``pad`` to ``band`` blocks of ``block x block``, as ``(rows, block,
    columns, block)``: summing axes 1 and 3 sums each block."""
    pad_h, pad_w = band[0] * block - a.shape[0], band[1] * block - a.shape[1]
    if pad_h or pad_w:
        a = np.pad(a, ((0, pad_h), (0, pad_w)), constant_values=pad)
    return a.reshape(band[0], block, band[1], block)


def _block_sums(a: npt.NDArray[Any], band: tuple[int, int], block: int) -> npt.NDArray[Any]:
    """Sums of the blocks of :func:`_blocks` (in ``a``'s float type): the rows of each block
    added as whole strided arrays, then each block's columns: a third of the time of numpy's sum
    over two axes of the 4-D view (25 against 70 ms for 4096 x 4096 float32 in 4 x 4 blocks)."""
    view = _blocks(a, band, block, 0)
    rows = view[:, 0].copy()
    for i in range(1, block):
        rows += view[:, i]
    return np.asarray(rows.sum(axis=-1))


def _reduce(values: npt.NDArray[Any], fill_value: Any, mark_fill: bool, block: int) -> _Reduced:
    """Means of the ``block x block`` blocks of the 2-D ``values`` (edge blocks: of the elements
    they hold), leaving out NaN and (``mark_fill``) fill-value elements. A band of rows at a
    time; a band without NaN, infinities or fill values (the common case) needs no masks."""
    height, width = values.shape
    out_h, out_w = -(-height // block), -(-width // block)
    marks_fill = _marks_fill(fill_value, mark_fill)
    mean = np.empty((out_h, out_w), dtype=np.float64)
    nan_out = np.zeros((out_h, out_w), dtype=bool)
    fill_out = np.zeros((out_h, out_w), dtype=bool)
    vmin, vmax = math.inf, -math.inf
    for start, stop in _bands(height, width, block):
        part = values[start:stop]
        data = _as_float(part)
        lo, hi = float(data.min()), float(data.max())  # NaN if any is NaN
        fill = (part == fill_value) if marks_fill else None
        if fill is not None and not fill.any():
            fill = None
        nan: npt.NDArray[np.bool_] | None = None
        missing: npt.NDArray[np.bool_] | None = None
        if not (math.isfinite(lo) and math.isfinite(hi)) or fill is not None:
            nan = np.isnan(data) if data.dtype.kind == "f" else None
            if nan is not None and not nan.any():
                nan = None
            if nan is not None and fill is not None:
                missing = nan | fill
            else:
                missing = nan if nan is not None else fill
            ranged = np.isfinite(data)
            if missing is not None:
                ranged &= ~missing
            lo = float(np.min(data, where=ranged, initial=math.inf))
            hi = float(np.max(data, where=ranged, initial=-math.inf))
        vmin, vmax = min(vmin, lo), max(vmax, hi)
        rows = slice(start // block, -(-stop // block))
        if block == 1:
            mean[rows] = data
            if missing is not None:
                mean[rows][missing] = np.nan
            if nan is not None:
                nan_out[rows] = nan
            if fill is not None:
                fill_out[rows] = fill if nan is None else fill & ~nan
            continue
        band = (rows.stop - rows.start, out_w)
        valid = None if missing is None else ~missing
        if valid is None and data.shape == (band[0] * block, band[1] * block):
            counts: npt.NDArray[Any] = np.full(band, block * block)
        else:
            ones = np.ones(data.shape, bool) if valid is None else valid
            counts = _blocks(ones, band, block, False).sum(axis=(1, 3))
        zeroed = data if valid is None else np.where(valid, data, 0)
        sums = _block_sums(zeroed, band, block)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean[rows] = sums / counts
        empty = counts == 0
        if empty.any():
            any_nan = (
                np.zeros_like(empty)
                if nan is None
                else _blocks(nan, band, block, False).any(axis=(1, 3))
            )
            nan_out[rows] = empty & any_nan
            fill_out[rows] = empty & ~any_nan
    found = vmin <= vmax
    return _Reduced(
        mean, None, None, nan_out, fill_out, vmin if found else None, vmax if found else None
    )


def _levels(
    values: npt.NDArray[np.floating[Any]], vmin: float | None, vmax: float | None
) -> npt.NDArray[np.uint8]:
    """Colormap levels of ``values`` (NaN gets level 0: the caller paints it over)."""
    if vmin is None or vmax is None:
        return np.zeros(values.shape, dtype=np.uint8)
    if vmax == vmin:
        scaled = np.where(values > vmax, LEVELS - 1.0, np.where(values < vmin, 0.0, LEVELS // 2))
    else:
        scaled = (values - vmin) * (LEVELS / (vmax - vmin))
    scaled = np.nan_to_num(scaled, nan=0.0, posinf=LEVELS - 1.0, neginf=0.0)
    return np.clip(scaled, 0, LEVELS - 1).astype(np.uint8)


def _image(reduced: _Reduced) -> npt.NDArray[np.uint8]:
    indices = _levels(reduced.mean, reduced.vmin, reduced.vmax)
    indices[reduced.nan] = NAN_INDEX
    indices[reduced.fill] = FILL_INDEX
    return indices


def _envelope(values: npt.NDArray[Any], fill_value: Any, mark_fill: bool, columns: int) -> _Reduced:
    """The 1-D ``values`` reduced to ``columns`` columns, column ``c`` covering the elements from
    ``c * n // columns`` to the next column's first (one element, repeated, when there are fewer
    elements than columns): the minimum and maximum of its values (NaN and, with ``mark_fill``,
    fill-value elements left out), and whether it holds nothing but those."""
    n = values.shape[0]
    data = _as_float(values)
    finite = np.isfinite(data) if data.dtype.kind == "f" else np.ones(n, dtype=bool)
    nan = np.isnan(data) if data.dtype.kind == "f" else np.zeros(n, dtype=bool)
    fill = (values == fill_value) if _marks_fill(fill_value, mark_fill) else np.zeros(n, bool)
    valid = ~nan & ~fill
    starts = (np.arange(columns, dtype=np.int64) * n) // columns
    low = np.minimum.reduceat(np.where(valid, data, np.inf), starts).astype(np.float64)
    high = np.maximum.reduceat(np.where(valid, data, -np.inf), starts).astype(np.float64)
    some = np.logical_or.reduceat(valid, starts)
    any_nan = np.logical_or.reduceat(nan, starts)
    ranged = valid & finite
    vmin = float(data[ranged].min()) if ranged.any() else None
    vmax = float(data[ranged].max()) if ranged.any() else None
    nan_out = (~some & any_nan)[None, :]
    fill_out = (~some & ~any_nan)[None, :]
    mean = np.where(some, (np.where(some, low, 0) + np.where(some, high, 0)) / 2, np.nan)[None, :]
    return _Reduced(mean, low[None, :], high[None, :], nan_out, fill_out, vmin, vmax)


def _line(reduced: _Reduced) -> npt.NDArray[np.uint8]:
    """A line of the 1-D ``reduced`` (one row of columns): each column spans its values' range
    and reaches the previous column's, so that the line is connected, one pixel thicker on each
    side; a column of nothing but NaN or fill values is a full-height band."""
    assert reduced.low is not None and reduced.high is not None
    low, high = reduced.low[0], reduced.high[0]
    height, margin = LINE_HEIGHT, _LINE_MARGIN
    missing = reduced.nan[0] | reduced.fill[0]
    vmin, vmax = reduced.vmin, reduced.vmax
    if vmin is None or vmax is None or vmax == vmin:
        top = bottom = np.full(low.shape, height // 2, dtype=np.int64)
    else:
        usable = height - 1 - 2 * margin

        def row(v: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
            clipped = np.clip(np.nan_to_num(v, nan=vmin), vmin, vmax)
            return np.round(margin + (vmax - clipped) / (vmax - vmin) * usable).astype(np.int64)

        top, bottom = row(high), row(low)
    join_top, join_bottom = top.copy(), bottom.copy()
    joined = np.concatenate([[False], ~missing[:-1]]) & ~missing
    join_top[1:] = np.where(joined[1:], np.minimum(top[1:], top[:-1]), top[1:])
    join_bottom[1:] = np.where(joined[1:], np.maximum(bottom[1:], bottom[:-1]), bottom[1:])
    rows = np.arange(height)[:, None]
    drawn = (rows >= join_top - 1) & (rows <= join_bottom + 1) & ~missing
    bands = np.where(reduced.nan[0], NAN_INDEX, FILL_INDEX)
    canvas = np.repeat(np.where(missing, bands, BACKGROUND_INDEX)[None, :], height, axis=0)
    canvas = canvas.astype(np.uint8)
    canvas[drawn] = LINE_INDEX
    return canvas


def render(
    array: Any,
    selection: Selection,
    *,
    max_pixels: int,
    max_source: int,
    text: Mapping[str, str] | None = None,
) -> Preview:
    """The preview of ``selection`` in the opened Zarr ``array`` (blocking: it reads chunks):
    the read planned by :func:`plan_read`, drawn as the module docs describe, ``text`` put in the
    PNG's ``tEXt`` chunks. Raises :class:`PreviewUnsupported`, :class:`PreviewTooLarge`,
    :class:`~zarrlake.serve.errors.BadRequest` (a selection that does not fit the array) and
    whatever reading the chunks raises."""
    shape = tuple(int(n) for n in array.shape)
    dtype = np.dtype(array.dtype)
    if dtype.kind not in _KINDS:
        raise PreviewUnsupported(
            f"no preview for data type {str(dtype)!r} (bool, integer and float arrays only)"
        )
    reason = previewable(str(dtype) if dtype.kind != "b" else "bool", list(shape))
    if reason:
        raise PreviewUnsupported(reason)
    ndim = len(shape)
    if selection.x >= ndim or (selection.y is not None and selection.y >= ndim):
        raise BadRequest(f"the array has dimensions 0 to {ndim - 1} only")
    if (selection.y is None) != (ndim == 1) or len(selection.index) != ndim:
        raise BadRequest("the selection does not fit this array's dimensions")
    chunks = tuple(int(c) for c in array.chunks)
    plan = plan_read(
        shape,
        chunks,
        selection,
        max_pixels=max_pixels,
        max_source=max_source,
        max_width=LINE_WIDTH,
    )
    key = tuple(
        slice(*selection.span(d, shape[d]), plan.step)
        if d in (selection.y, selection.x)
        else selection.index[d]
        for d in range(ndim)
    )
    values = np.asarray(array[key])
    if selection.y is not None and selection.y > selection.x:
        values = values.T
    fill_value = array.fill_value
    if ndim == 1:
        reduced = _envelope(values, fill_value, selection.mark_fill, plan.out_shape[0])
        indices, kind = _line(reduced), "line"
    else:
        reduced = _reduce(values, fill_value, selection.mark_fill, plan.block)
        indices, kind = _image(reduced), "image"
    meta = dict(text or {})
    if reduced.vmin is not None and reduced.vmax is not None:
        meta.update({"zarrlake:min": repr(reduced.vmin), "zarrlake:max": repr(reduced.vmax)})
    png = encode_png(indices, PALETTE, meta, level=1 if indices.size > 1 << 18 else 6)
    return Preview(
        png,
        width=int(indices.shape[1]),
        height=int(indices.shape[0]),
        vmin=reduced.vmin,
        vmax=reduced.vmax,
        nan_pixels=int(reduced.nan.sum()),
        fill_pixels=int(reduced.fill.sum()),
        plan=plan,
        kind=kind,
    )
