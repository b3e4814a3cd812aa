"""The preview images of :mod:`zarrlake.serve.preview`, decoded back by a PNG reader of our own
(stdlib ``zlib`` and ``struct``): exact pixels of small known arrays, NaN and fill colours, the
pixel and source bounds, strided reads of slices too large to read whole, the colour bar, the
colormap's rising lightness, the 1-D line, and the selection's parsing and its errors.
"""

from __future__ import annotations

import itertools
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.storage import MemoryStore

from zarrlake.serve import preview
from zarrlake.serve.errors import BadRequest
from zarrlake.serve.preview import (
    COLORMAP,
    FILL_RGB,
    LEVELS,
    LINE_HEIGHT,
    LINE_WIDTH,
    NAN_RGB,
    PreviewTooLarge,
    PreviewUnsupported,
    Selection,
    colorbar_png,
    encode_png,
    plan_read,
    previewable,
    render,
)

BIG = 1 << 30  # "no bound" for max_pixels / max_source


@dataclass
class Png:
    width: int
    height: int
    indices: np.ndarray  # (height, width) uint8
    palette: np.ndarray  # (n, 3) uint8
    text: dict[str, str]

    @property
    def rgb(self) -> np.ndarray:
        return self.palette[self.indices]


def decode_png(data: bytes) -> Png:
    """A strict reader of the PNGs the encoder writes: signature, every chunk's CRC, an 8-bit
    palette image, unfiltered rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and pos == len(data)
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1]
    )
    assert (depth, colour, compression, filtering, interlace) == (8, 3, 0, 0, 0)
    palette = np.frombuffer(dict(chunks)[b"PLTE"], dtype=np.uint8).reshape(-1, 3)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, width + 1)
    assert (rows[:, 0] == 0).all(), "rows are written unfiltered"
    indices = rows[:, 1:]
    assert int(indices.max()) < len(palette)
    text = {}
    for kind, body in chunks:
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            text[key.decode("latin-1")] = value.decode("latin-1")
    return Png(width, height, indices, palette, text)


def array(values: np.ndarray, chunks: tuple[int, ...] | None = None, **kw: Any) -> zarr.Array:
    a = zarr.create_array(
        MemoryStore(), shape=values.shape, chunks=chunks or values.shape, dtype=values.dtype, **kw
    )
    a[...] = values
    return a


def shown(a: zarr.Array, selection: Selection | None = None, **limits: int) -> preview.Preview:
    """The preview of ``selection`` (by default: the last dimensions, fill value as data)."""
    return render(
        a,
        selection or Selection.default(tuple(a.shape), mark_fill=False),
        max_pixels=limits.get("max_pixels", BIG),
        max_source=limits.get("max_source", BIG),
    )


def level(v: float, vmin: float, vmax: float) -> int:
    """The documented mapping of a value to a colormap level."""
    return min(LEVELS - 1, int(np.floor((v - vmin) / (vmax - vmin) * LEVELS)))


# -- PNG -----------------------------------------------------------------------------------------


def test_encoded_png_decodes_to_the_same_indices_palette_and_text() -> None:
    rng = np.random.default_rng(0)
    indices = rng.integers(0, 7, size=(13, 29), dtype=np.uint8)
    palette = rng.integers(0, 256, size=(7, 3), dtype=np.uint8)
    png = decode_png(encode_png(indices, palette, {"Title": "ünï /a@snap"}))
    assert (png.width, png.height) == (29, 13)
    np.testing.assert_array_equal(png.indices, indices)
    np.testing.assert_array_equal(png.palette, palette)
    assert png.text == {"Title": "ünï /a@snap"}


def test_encoder_refuses_an_empty_image_or_a_palette_over_256() -> None:
    with pytest.raises(ValueError):
        encode_png(np.zeros((0, 3), np.uint8), COLORMAP)
    with pytest.raises(ValueError):
        encode_png(np.zeros((2, 2), np.uint8), np.zeros((257, 3), np.uint8))


# -- colours -------------------------------------------------------------------------------------


def oklab_lightness(rgb: np.ndarray) -> np.ndarray:
    """Oklab L of sRGB colours (Ottosson's forward matrices): independent of the module's
    inverse, so a mistake there shows here."""
    c = rgb / 255.0
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    m1 = np.array(
        [
            [0.4122214708, 0.5363325363, 0.0514459929],
            [0.2119034982, 0.6806995451, 0.1073969566],
            [0.0883024619, 0.2817188376, 0.6299787005],
        ]
    )
    lms = np.cbrt(linear @ m1.T)
    return lms @ np.array([0.2104542553, 0.7936177850, -0.0040720468])


def test_colormap_rises_evenly_in_lightness_from_dark_violet_to_yellow() -> None:
    assert COLORMAP.shape == (LEVELS, 3) and COLORMAP.dtype == np.uint8
    lightness = oklab_lightness(COLORMAP.astype(float))
    steps = np.diff(lightness)
    # Never darker; 8-bit rounding makes a few neighbours of 252 levels the same colour, but
    # every fourth level is lighter than the one before, by an even step.
    assert (steps >= 0).all() and (steps == 0).sum() <= 4
    coarse = np.diff(lightness[::4])
    assert (coarse > 0).all()
    assert coarse.max() < 1.6 * coarse.mean() and coarse.min() > 0.5 * coarse.mean()
    assert lightness[0] < 0.35 and lightness[-1] > 0.88
    r, g, b = (int(v) for v in COLORMAP[0])
    assert b > g and r > g, "starts violet"
    r, g, b = (int(v) for v in COLORMAP[-1])
    assert r > 200 and g > 200 and b < 90, "ends yellow"
    # NaN and fill never look like a value (the line's colour is drawn on white, not among them).
    for special in (NAN_RGB, FILL_RGB):
        assert np.abs(COLORMAP.astype(int) - special).sum(axis=1).min() > 30, special
    assert np.abs(np.subtract(NAN_RGB, FILL_RGB)).sum() > 30


def test_colour_bar_runs_the_colormap_from_minimum_to_maximum() -> None:
    png = decode_png(colorbar_png(LEVELS, 3))
    assert (png.width, png.height) == (LEVELS, 3)
    np.testing.assert_array_equal(png.rgb[0], COLORMAP)
    np.testing.assert_array_equal(png.rgb[2], COLORMAP)
    wide = decode_png(colorbar_png(1000, 1)).rgb[0]
    np.testing.assert_array_equal(wide[0], COLORMAP[0])
    np.testing.assert_array_equal(wide[-1], COLORMAP[-1])


# -- exact pixels --------------------------------------------------------------------------------


def test_a_small_float_array_has_exactly_the_documented_pixels() -> None:
    values = np.array([[0.0, 1.0, 2.0], [3.0, 4.5, 6.0]], dtype="f4")
    p = shown(array(values))
    png = decode_png(p.png)
    assert (png.width, png.height) == (3, 2) and (p.vmin, p.vmax) == (0.0, 6.0)
    expected = np.array([[level(v, 0, 6) for v in row] for row in values])
    np.testing.assert_array_equal(png.indices, expected)
    np.testing.assert_array_equal(png.rgb[0, 0], COLORMAP[0])
    np.testing.assert_array_equal(png.rgb[1, 2], COLORMAP[LEVELS - 1])
    assert png.text["zarrlake:min"] == "0.0" and png.text["zarrlake:max"] == "6.0"


def test_nan_and_fill_have_their_own_colours_and_stay_out_of_the_range() -> None:
    values = np.array([[np.nan, 10.0, 20.0], [-7.0, 30.0, np.nan]], dtype="f8")
    p = shown(array(values, fill_value=-7.0), Selection(0, 1, (0, 0), mark_fill=True))
    rgb = decode_png(p.png).rgb
    assert tuple(rgb[0, 0]) == NAN_RGB and tuple(rgb[1, 2]) == NAN_RGB
    assert tuple(rgb[1, 0]) == FILL_RGB
    assert (p.vmin, p.vmax, p.nan_pixels, p.fill_pixels) == (10.0, 30.0, 2, 1)
    np.testing.assert_array_equal(rgb[0, 1], COLORMAP[0])
    np.testing.assert_array_equal(rgb[1, 1], COLORMAP[-1])
    # Fill value shown as data: it is the minimum now.
    data = shown(array(values, fill_value=-7.0), Selection(0, 1, (0, 0), mark_fill=False))
    assert (data.vmin, data.fill_pixels) == (-7.0, 0)
    np.testing.assert_array_equal(decode_png(data.png).rgb[1, 0], COLORMAP[0])


def test_infinities_take_the_ends_of_the_scale_without_stretching_it() -> None:
    values = np.array([[np.inf, 1.0], [2.0, -np.inf]], dtype="f4")
    p = shown(array(values))
    rgb = decode_png(p.png).rgb
    assert (p.vmin, p.vmax) == (1.0, 2.0)
    np.testing.assert_array_equal(rgb[0, 0], COLORMAP[-1])
    np.testing.assert_array_equal(rgb[1, 1], COLORMAP[0])


def test_a_constant_slice_is_the_middle_colour_and_an_all_nan_one_grey() -> None:
    flat = shown(array(np.full((2, 2), 5, dtype="i2")))
    assert (flat.vmin, flat.vmax) == (5.0, 5.0)
    assert (decode_png(flat.png).indices == LEVELS // 2).all()
    empty = shown(array(np.full((2, 2), np.nan, dtype="f4")))
    assert empty.vmin is None and empty.vmax is None and empty.nan_pixels == 4
    assert (decode_png(empty.png).rgb == NAN_RGB).all()


def test_bool_and_large_integer_arrays() -> None:
    mask = np.array([[True, False], [False, True]])
    p = shown(array(mask), Selection(0, 1, (0, 0), mark_fill=False))
    png = decode_png(p.png)
    assert (p.vmin, p.vmax) == (0.0, 1.0)
    np.testing.assert_array_equal(png.rgb[0, 0], COLORMAP[-1])
    np.testing.assert_array_equal(png.rgb[0, 1], COLORMAP[0])
    big = np.array([[0, 2**62], [2**63 - 1, 2**61]], dtype="i8")
    pb = shown(array(big))
    assert pb.vmax == float(2**63 - 1)
    np.testing.assert_array_equal(decode_png(pb.png).rgb[1, 0], COLORMAP[-1])


def test_rows_and_columns_follow_the_selection_and_other_dimensions_their_index() -> None:
    cube = np.arange(3 * 4 * 5, dtype="f4").reshape(3, 4, 5)
    a = array(cube, chunks=(1, 2, 2))
    p = shown(a, Selection(1, 2, (2, 0, 0)))  # cube[2]: 4 rows, 5 columns
    png = decode_png(p.png)
    assert (png.height, png.width) == (4, 5) and (p.vmin, p.vmax) == (40.0, 59.0)
    t = shown(a, Selection(2, 1, (1, 0, 0)))  # cube[1].T: 5 rows, 4 columns
    tpng = decode_png(t.png)
    assert (tpng.height, tpng.width) == (5, 4)
    expected = np.array([[level(v, 20, 39) for v in row] for row in cube[1].T])
    np.testing.assert_array_equal(tpng.indices, expected)
    side = shown(a, Selection(0, 2, (0, 3, 0)))  # cube[:, 3, :]
    assert (side.vmin, side.vmax) == (15.0, 59.0)


# -- bounds --------------------------------------------------------------------------------------


def test_a_large_slice_is_reduced_to_block_means_within_max_pixels() -> None:
    rng = np.random.default_rng(1)
    values = rng.random((30, 50)).astype("f4")
    values[0:3, 0:3] = np.nan  # one whole block of NaN
    values[3, 3] = np.nan  # one NaN in a block: the mean of the rest
    p = shown(array(values, chunks=(8, 8)), max_pixels=200)
    png = decode_png(p.png)
    assert png.width * png.height <= 200
    assert p.plan.block == 3 and (png.height, png.width) == (10, 17)
    assert tuple(png.rgb[0, 0]) == NAN_RGB and p.nan_pixels == 1
    vmin, vmax = float(np.nanmin(values)), float(np.nanmax(values))
    for r, c in [(1, 1), (4, 7), (9, 16)]:
        block = values[3 * r : 3 * r + 3, 3 * c : 3 * c + 3]
        assert png.indices[r, c] == level(float(np.nanmean(block)), vmin, vmax), (r, c)


def test_the_pixel_bound_holds_for_every_shape() -> None:
    for shape in [(1, 5000), (5000, 1), (999, 1001), (7, 13), (4096, 4096), (10**6, 3)]:
        for max_pixels in (1, 100, 1000, 1 << 20):
            plan = plan_read(shape, shape, Selection(0, 1, (0, 0)), max_pixels=max_pixels,
                             max_source=BIG)  # fmt: skip
            h, w = plan.out_shape
            assert h * w <= max_pixels, (shape, max_pixels)
            # ... with the smallest block that keeps it.
            if plan.block > 1:
                smaller = plan.block - 1
                assert -(-shape[0] // smaller) * -(-shape[1] // smaller) > max_pixels


def chunks_touched_by_brute_force(n: int, chunk: int, step: int, start: int = 0) -> int:
    return len({i // chunk for i in range(start, start + n, step)})


def test_chunks_touched_by_a_stride_are_counted_exactly() -> None:
    for n in range(1, 40):
        for chunk in range(1, 12):
            for step in range(1, 15):
                for start in (0, 1, 5, 11):
                    expected = chunks_touched_by_brute_force(n, chunk, step, start)
                    got = preview._chunks_touched(n, chunk, step, start)
                    assert got == expected, (n, chunk, step, start)


def test_a_slice_over_the_source_bound_is_read_strided_within_it() -> None:
    values = np.arange(64 * 64, dtype="f4").reshape(64, 64)
    a = array(values, chunks=(4, 4))
    p = shown(a, max_source=16 * 16)
    plan = p.plan
    assert plan.sampled and plan.decoded <= 16 * 16
    # The smallest such stride: one less decodes or reads too much.
    smaller = plan.step - 1
    touched = chunks_touched_by_brute_force(64, 4, smaller) ** 2 * 16
    reads = (-(-64 // smaller)) ** 2
    assert touched > 16 * 16 or reads > 16 * 16
    png = decode_png(p.png)
    sampled = values[:: plan.step, :: plan.step]
    assert (png.height, png.width) == sampled.shape
    lo, hi = float(sampled.min()), float(sampled.max())
    expected = np.array([[level(v, lo, hi) for v in row] for row in sampled])
    np.testing.assert_array_equal(png.indices, expected)


def test_a_huge_1d_array_with_huge_chunks_is_planned_quickly_within_the_bound() -> None:
    started = time.perf_counter()
    n, chunk = 10**10, 10**6
    plan = plan_read((n,), (chunk,), Selection(None, 0, (0,)), max_pixels=BIG, max_source=10**8)
    assert time.perf_counter() - started < 0.5
    assert plan.decoded <= 10**8 and plan.step >= chunk
    assert -(-n // plan.step) * chunk <= 10**8


def test_a_slice_whose_chunks_exceed_the_bound_is_refused_413() -> None:
    a = array(np.zeros((100, 100), dtype="f4"), chunks=(100, 100))
    with pytest.raises(PreviewTooLarge) as raised:
        shown(a, max_source=5000)
    assert raised.value.status == 413 and "10,000 elements" in str(raised.value)


# -- one dimension -------------------------------------------------------------------------------


def line_rows(png: Png) -> list[tuple[int, int]]:
    """(top, bottom) of the line's pixels in each column."""
    drawn = png.indices == 255
    out = []
    for c in range(png.width):
        rows = np.flatnonzero(drawn[:, c])
        out.append((int(rows.min()), int(rows.max())) if rows.size else (-1, -1))
    return out


def test_a_1d_array_is_a_connected_line_rising_with_its_values() -> None:
    ramp = np.linspace(-1, 1, 5000)
    p = shown(array(ramp, chunks=(700,)))
    png = decode_png(p.png)
    assert p.kind == "line" and (png.height, png.width) == (LINE_HEIGHT, LINE_WIDTH)
    rows = line_rows(png)
    assert all(top >= 0 for top, _ in rows), "every column has line pixels"
    assert rows[0][1] >= LINE_HEIGHT - 10 and rows[-1][0] <= 10
    for (top_a, bottom_a), (top_b, bottom_b) in itertools.pairwise(rows):
        assert top_b <= bottom_a + 1 and bottom_b >= top_a - 1, "connected"
        assert top_b <= top_a, "rising"
    assert (p.vmin, p.vmax) == (-1.0, 1.0)


def test_a_short_1d_array_is_a_step_line_with_nan_bands() -> None:
    values = np.array([0.0, 1.0, np.nan, 1.0], dtype="f4")
    p = shown(array(values))
    png = decode_png(p.png)
    quarter = LINE_WIDTH // 4
    band = png.rgb[:, 2 * quarter + quarter // 2]
    assert (band == NAN_RGB).all(), "the NaN element is a full-height grey band"
    rows = line_rows(png)
    assert rows[quarter // 2][0] > rows[quarter + quarter // 2][0], "0 is drawn below 1"
    assert p.nan_pixels == quarter


# -- what has a preview, and selections ----------------------------------------------------------


def test_only_bool_integer_and_float_arrays_of_one_or_more_dimensions() -> None:
    assert previewable("float32", [3, 4]) is None and previewable("bool", [2]) is None
    assert previewable("uint64", [1, 1, 1]) is None
    assert "complex64" in (previewable("complex64", [3]) or "")
    assert "0-dimensional" in (previewable("float32", []) or "")
    assert "empty" in (previewable("int8", [0, 4]) or "")
    strings = zarr.create_array(MemoryStore(), shape=(3,), chunks=(3,), dtype="str")
    with pytest.raises(PreviewUnsupported) as raised:
        shown(strings)
    assert raised.value.status == 422


def parse(shape: tuple[int, ...], **params: str) -> Selection:
    return Selection.parse(shape, params, names=["time", "lat", "lon"][: len(shape)])


def test_selection_defaults_and_round_trip() -> None:
    assert parse((4, 5, 6)) == Selection(1, 2, (0, 0, 0))
    assert parse((9,)) == Selection(None, 0, (0,))
    sel = parse((4, 5, 6), y="0", x="2", i1="3", fill="data")
    assert sel == Selection(0, 2, (0, 3, 0), mark_fill=False)
    assert Selection.parse((4, 5, 6), sel.query()) == sel
    # Only one given, onto the other's default: the two swap.
    assert parse((4, 5), x="0") == Selection(1, 0, (0, 0))
    assert parse((4, 5), y="1") == Selection(1, 0, (0, 0))
    assert parse((4, 5, 6), y="2") == Selection(2, 1, (0, 0, 0))


def test_windows_belong_to_image_dimensions() -> None:
    sel = parse((4, 5, 6), w1="2:5", w2=":3", w0="1:2")
    assert sel.windows == ((1, 2, 5), (2, 0, 3)), "w0 is ignored: time is not in the image"
    assert sel.span(1, 5) == (2, 5) and sel.span(2, 6) == (0, 3)
    assert Selection.parse((4, 5, 6), sel.query()) == sel
    assert parse((4, 5, 6), w1="0:5", w2="0:").windows == (), "a whole dimension: no window"
    # Drawn the other way round, the windows stay with their dimensions.
    assert parse((4, 5, 6), y="2", x="1", w1="2:5").windows == ((1, 2, 5),)


def test_zooming_halves_the_window_around_the_centre_within_the_array() -> None:
    sel = Selection.default((100, 200))
    z = sel.zoomed((100, 200), {0: 25.0, 1: 100.0}, 2.0)
    assert z.windows == ((0, 0, 50), (1, 50, 150))
    z2 = z.zoomed((100, 200), {0: 5.0, 1: 124.0}, 2.0)
    assert z2.windows == ((0, 0, 25), (1, 99, 149)), "rows clamped to the array"
    z3 = z.zoomed((100, 200), {0: 50.0, 1: 195.0}, 2.0)
    assert z3.windows == ((0, 38, 63), (1, 150, 200)), "columns clamped to the array"
    tiny = Selection.default((100, 200)).with_windows((100, 200), {0: (10, 18)})
    assert tiny.zoomed((100, 200), {0: 14.0}, 2.0).span(0, 100) == (10, 18), "MIN_WINDOW"
    out = z.zoomed((100, 200), {0: 25.0, 1: 100.0}, 0.5)
    assert out.windows == (), "out again: the whole slice"


def test_a_window_shows_exactly_its_elements() -> None:
    values = np.arange(20 * 30, dtype="f4").reshape(20, 30)
    a = array(values, chunks=(7, 7))
    sel = Selection(0, 1, (0, 0), False, ((0, 3, 9), (1, 10, 14)))
    p = shown(a, sel)
    png = decode_png(p.png)
    part = values[3:9, 10:14]
    assert (png.height, png.width) == part.shape
    assert (p.vmin, p.vmax) == (float(part.min()), float(part.max()))
    expected = np.array([[level(v, part.min(), part.max()) for v in row] for row in part])
    np.testing.assert_array_equal(png.indices, expected)
    # Its plan counts the chunks of the window only: rows 3-8 in chunks 0 and 1, columns
    # 10-13 in chunk 1.
    plan = plan_read((20, 30), (7, 7), sel, max_pixels=BIG, max_source=BIG)
    assert plan.decoded == 2 * 1 * 49 and plan.source_shape == (6, 4)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"y": "abc"}, "y must be an integer, not 'abc'"),
        ({"x": "1.5"}, "x must be an integer"),
        ({"y": "3"}, "y=3: the array has dimensions 0 to 2 only"),
        ({"x": "-1"}, "x=-1: the array has dimensions 0 to 2 only"),
        ({"y": "1", "x": "1"}, "y and x are both dimension 1 ('lat')"),
        ({"i0": "4"}, "i0=4 is out of range for dimension 0 ('time') of size 4"),
        ({"i0": "-1"}, "i0=-1 is out of range"),
        ({"i0": "9" * 30}, "i0 must be an integer"),
        ({"fill": "maybe"}, "fill must be 'mark' or 'data'"),
        ({"w1": "3"}, "w1 must be start:stop, not '3'"),
        ({"w1": "a:4"}, "w1 must be an integer, not 'a'"),
        ({"w1": "4:2"}, "w1=4:2 is not a window of dimension 1 ('lat') of size 5"),
        ({"w2": "0:7"}, "w2=0:7 is not a window of dimension 2 ('lon') of size 6"),
    ],
)
def test_bad_selections_say_what_is_wrong(params: dict[str, str], message: str) -> None:
    with pytest.raises(BadRequest) as raised:
        parse((4, 5, 6), **params)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert raised.value.status == 400
