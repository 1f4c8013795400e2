"""A bar chart of the run as a PNG: with matplotlib when it is installed, otherwise drawn
here with a 3x5 pixel font and written with zlib + struct, so a run never needs it."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    """One group of horizontal bars: (label, value, target or None) with a line at `ref`."""

    title: str
    bars: list[tuple[str, float, float | None]]
    ref: float
    fmt: str  # how a value is written next to its bar, e.g. "{:.2f}x"


def write_chart(path: Path, title: str, panels: list[Panel]) -> str:
    """Draw the panels to `path`; returns which renderer drew them."""
    panels = [p for p in panels if p.bars]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        Path(path).write_bytes(render_png(title, panels))
        return "builtin"
    _matplotlib_chart(plt, path, title, panels)
    return "matplotlib"


def _matplotlib_chart(plt, path: Path, title: str, panels: list[Panel]) -> None:
    heights = [max(1.5, 0.35 * len(p.bars) + 0.8) for p in panels] or [1.5]
    fig, axes = plt.subplots(len(heights), 1, figsize=(9, sum(heights)), squeeze=False)
    fig.suptitle(title)
    for ax, panel in zip(axes[:, 0], panels):
        labels = [b[0] for b in panel.bars][::-1]
        values = [b[1] for b in panel.bars][::-1]
        ax.barh(labels, values, color="#4c72b0")
        ax.axvline(panel.ref, color="black", linewidth=1)
        for y, (_, value, target) in enumerate(panel.bars[::-1]):
            ax.text(value, y, " " + panel.fmt.format(value), va="center", fontsize=8)
            if target is not None:
                ax.plot([target, target], [y - 0.4, y + 0.4], color="#dd8452", linewidth=2)
        ax.set_title(panel.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the built-in renderer ---------------------------------------------------------------------

# Each glyph is 5 rows of 3 pixels; lowercase letters are drawn as capitals.
_GLYPHS = {
    "A": "010 101 111 101 101", "B": "110 101 110 101 110", "C": "011 100 100 100 011",
    "D": "110 101 101 101 110", "E": "111 100 110 100 111", "F": "111 100 110 100 100",
    "G": "011 100 101 101 011", "H": "101 101 111 101 101", "I": "111 010 010 010 111",
    "J": "001 001 001 101 010", "K": "101 101 110 101 101", "L": "100 100 100 100 111",
    "M": "101 111 111 101 101", "N": "110 101 101 101 101", "O": "010 101 101 101 010",
    "P": "110 101 110 100 100", "Q": "010 101 101 110 011", "R": "110 101 110 101 101",
    "S": "011 100 010 001 110", "T": "111 010 010 010 010", "U": "101 101 101 101 111",
    "V": "101 101 101 101 010", "W": "101 101 111 111 101", "X": "101 101 010 101 101",
    "Y": "101 101 010 010 010", "Z": "111 001 010 100 111", "0": "111 101 101 101 111",
    "1": "010 110 010 010 111", "2": "110 001 010 100 111", "3": "110 001 010 001 110",
    "4": "101 101 111 001 001", "5": "111 100 110 001 110", "6": "011 100 111 101 111",
    "7": "111 001 010 010 010", "8": "111 101 111 101 111", "9": "111 101 111 001 110",
    ".": "000 000 000 000 010", ",": "000 000 000 010 100", "-": "000 000 111 000 000",
    "/": "001 001 010 100 100", "%": "101 001 010 100 101", "(": "010 100 100 100 010",
    ")": "010 001 001 001 010", ":": "000 010 000 010 000", ";": "000 010 000 010 100", "_": "000 000 000 000 111",
    "+": "000 010 111 010 000", "=": "000 111 000 111 000", ">": "100 010 001 010 100",
    "<": "001 010 100 010 001", "?": "110 001 010 000 010", " ": "000 000 000 000 000",
}  # fmt: skip

SCALE = 2  # screen pixels per font pixel
CHAR_W = 4 * SCALE  # 3 pixels and a gap
ROW_H = 11 * SCALE
WHITE, BLACK, GREY = (255, 255, 255), (30, 30, 30), (200, 200, 200)
BLUE, ORANGE = (76, 114, 176), (221, 132, 82)


class Canvas:
    """An RGB image as a bytearray, with just rectangles and text."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, x0), min(self.width, x1)
        row = bytes(color) * max(0, x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            start = (y * self.width + x0) * 3
            self.pixels[start : start + len(row)] = row

    def text(self, x: int, y: int, text: str, color=BLACK) -> None:
        for i, char in enumerate(text):
            rows = _GLYPHS.get(char.upper(), _GLYPHS["?"]).split()
            for dy, bits in enumerate(rows):
                for dx, bit in enumerate(bits):
                    if bit == "1":
                        px, py = x + i * CHAR_W + dx * SCALE, y + dy * SCALE
                        self.rect(px, py, px + SCALE, py + SCALE, color)


def render_png(title: str, panels: list[Panel], width: int = 960) -> bytes:
    """The chart as PNG bytes: per panel a title, then one labelled bar per row."""
    label_w = CHAR_W * max([len(b[0]) for p in panels for b in p.bars] or [10]) + 16
    plot_x0, plot_x1 = label_w, width - CHAR_W * 9
    height = ROW_H * (3 + sum(len(p.bars) + 2 for p in panels))
    canvas = Canvas(width, height)
    canvas.text(8, 8, title)
    canvas.text(8, 8 + ROW_H, "black line: parity or the limit; orange tick: target", GREY)
    y = 3 * ROW_H
    for panel in panels:
        canvas.text(8, y, panel.title)
        y += ROW_H
        values = [v for _, v, _ in panel.bars] + [t or 0 for _, _, t in panel.bars]
        scale = (plot_x1 - plot_x0) / (max([*values, panel.ref]) * 1.05)
        ref_x = plot_x0 + int(panel.ref * scale)
        canvas.rect(ref_x, y, ref_x + 1, y + ROW_H * len(panel.bars), BLACK)  # under the bars
        for label, value, target in panel.bars:
            canvas.text(8, y + 3 * SCALE, label)
            bar_end = plot_x0 + int(max(value, 0.0) * scale)
            canvas.rect(plot_x0, y + 2, bar_end, y + ROW_H - 4, BLUE)
            text = panel.fmt.format(value)
            canvas.rect(bar_end + 4, y, bar_end + 8 + CHAR_W * len(text), y + ROW_H - 2, WHITE)
            canvas.text(bar_end + 6, y + 3 * SCALE, text)
            if target is not None:  # last, so no value text hides it
                tx = plot_x0 + int(target * scale)
                canvas.rect(tx - 1, y, tx + 2, y + ROW_H - 2, ORANGE)
            y += ROW_H
        canvas.rect(plot_x0, y + 2, plot_x1, y + 3, GREY)
        y += ROW_H
    return encode_png(canvas.pixels, width, height)


def encode_png(pixels: bytes, width: int, height: int) -> bytes:
    """8-bit RGB pixels, row by row -> a PNG file (no filtering, one zlib stream)."""
    stride = width * 3
    raw = b"".join(b"\x00" + pixels[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(bytes(raw), 9))
        + chunk(b"IEND", b"")
    )
