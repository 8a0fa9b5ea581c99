"""The desktop of the gui suite: a seeded scene, its state machine and its Pillow rendering. No JAX.

A `Desk` holds icons (one per app, at seeded positions and sizes) and at most one open window
(modal: clicks outside it do nothing). With a grid (`grid=(cols, rows)`) the screen is split
into equal cells, numbered 1.. row by row from the top left, and each icon (its square and
label) is centred in a cell of its own, drawn per seed, so every cell's centre is on its icon's
square; sizes still vary per icon. `app_colors=True` draws each app in its own fixed colour
(the layout stays that of the seed). A window has a title bar with a close box, one or two
labelled text fields and OK / Cancel buttons; it opens at a seeded position and size that
change each time it opens. `click(x, y)` hits the topmost thing under the point; `type(text)`
replaces the focused field's text. Pressing OK submits the form (the event a task checks) and
closes the window; Cancel or the close box closes it without submitting.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

APPS = ("Settings", "Notes", "Mail", "Files", "Music", "Photos", "Maps", "Clock", "Calendar",
        "Terminal", "Browser", "Camera")
FIELDS = ("Name", "Email", "Title", "City", "Phone", "Tag", "User", "Label", "Note", "Topic")
COLORS = ((52, 101, 164), (204, 0, 0), (78, 154, 6), (117, 80, 123), (193, 125, 17),
          (6, 152, 154), (143, 89, 2), (196, 40, 120), (46, 52, 54), (32, 74, 135),
          (92, 53, 102), (164, 0, 0))
DESKTOPS = ((238, 238, 236), (211, 215, 207), (186, 189, 182), (220, 230, 242), (230, 220, 200))
TITLE_H, FIELD_H, BUTTON_W, BUTTON_H, PAD = 22, 22, 64, 24, 10
LABEL_H = 16  # an icon's label under its square
MIN_SIDE = 18  # a grid icon's smallest square: its cell's centre is always on the square
MIN_CELL = (64, MIN_SIDE + 24)  # a grid cell's least width (an icon's label) and height

Box = tuple[int, int, int, int]  # x0, y0, x1, y1 (inclusive-exclusive)


def inside(box: Box, x: int, y: int) -> bool:
    return box[0] <= x < box[2] and box[1] <= y < box[3]


def center(box: Box) -> tuple[int, int]:
    return (box[0] + box[2]) // 2, (box[1] + box[3]) // 2


def cell_boxes(width: int, height: int, grid: tuple[int, int]) -> list[Box]:
    """The cells of a `cols` x `rows` grid over the screen, row by row from the top left."""
    cols, rows = grid
    return [(c * width // cols, r * height // rows, (c + 1) * width // cols,
             (r + 1) * height // rows) for r in range(rows) for c in range(cols)]


@dataclasses.dataclass
class Icon:
    app: str
    box: Box
    """The icon's square and its label below it: a click on either opens the app."""
    square: Box
    color: tuple[int, int, int]
    fields: tuple[str, ...]
    cell: int = 0
    """Its grid cell (1-based, row by row), 0 without a grid."""


@dataclasses.dataclass
class Window:
    app: str
    box: Box
    color: tuple[int, int, int]
    fields: dict[str, Box]
    values: dict[str, str]
    close: Box
    ok: Box
    cancel: Box
    focus: str = ""


@dataclasses.dataclass(frozen=True)
class Event:
    """What a click or a typed text did: `kind` is opened, closed, submitted, focused, typed or
    nothing; `values` are the form's on submit."""

    kind: str
    app: str = ""
    detail: str = ""
    values: tuple[tuple[str, str], ...] = ()


class Desk:
    """One seeded desktop of `width` x `height` pixels with `icons` apps (module docstring)."""

    def __init__(self, seed: int, width: int, height: int, icons: int,
                 grid: tuple[int, int] | None = None, app_colors: bool = False):
        self.seed, self.width, self.height = seed, width, height
        rng = random.Random(seed)
        self.background = rng.choice(DESKTOPS)
        apps = rng.sample(APPS, icons)
        colors = rng.sample(COLORS, icons)
        if app_colors:
            colors = [COLORS[APPS.index(app)] for app in apps]
        self.cells = cell_boxes(width, height, grid) if grid else []
        if len(self.cells) < icons and grid:
            raise ValueError(f"{icons} icons do not fit a {grid[0]}x{grid[1]} grid")
        order = rng.sample(range(len(self.cells)), icons) if grid else []
        self.icons: list[Icon] = []
        taken: list[Box] = []
        for k, (app, color) in enumerate(zip(apps, colors, strict=True)):
            if grid:
                box, square = self._grid_icon(rng, self.cells[order[k]])
            else:
                box, square = self._place_icon(rng, taken)
            fields = tuple(rng.sample(FIELDS, rng.choice((1, 2))))
            self.icons.append(Icon(app, box, square, color, fields, order[k] + 1 if grid else 0))
            taken.append(box)
        self.window: Window | None = None
        self.opened = 0

    @staticmethod
    def _grid_icon(rng: random.Random, cell: Box) -> tuple[Box, Box]:
        """An icon of seeded size whose square and label are centred in `cell`."""
        cw, ch = cell[2] - cell[0], cell[3] - cell[1]
        hi = min(ch - 24, cw - 8)
        side = rng.randint(max(MIN_SIDE, hi // 2), hi)
        w = max(side, 60)  # the label under it is up to ~60 px wide
        cx, cy = center(cell)
        x, y = cx - w // 2, cy - (side + LABEL_H) // 2
        sx = x + (w - side) // 2
        return (x, y, x + w, y + side + LABEL_H), (sx, y, sx + side, y + side)

    def _place_icon(self, rng: random.Random, taken: list[Box]) -> tuple[Box, Box]:
        for _ in range(500):
            side = rng.randint(max(16, self.height // 16), max(24, self.height // 7))
            w = max(side, 60)  # the label under it is up to ~60 px wide
            x = rng.randint(4, self.width - w - 4)
            y = rng.randint(4, self.height - side - 20)
            box = (x, y, x + w, y + side + 16)
            if not any(_overlap(box, t, 6) for t in taken):
                sx = x + (w - side) // 2
                return box, (sx, y, sx + side, y + side)
        raise ValueError(f"cannot place {len(taken) + 1} icons on a {self.width}x{self.height} "
                         "screen; use fewer icons or a larger screen")

    def icon(self, app: str) -> Icon:
        return next(i for i in self.icons if i.app == app)

    def click_cell(self, cell: int) -> Event:
        """A click at the centre of grid cell `cell` (1-based)."""
        return self.click(*center(self.cells[cell - 1]))

    def close_window(self) -> Event:
        """A click on the open window's close box (nothing when no window is open)."""
        if self.window is None:
            return Event("nothing", detail="no window is open")
        return self.click(*center(self.window.close))

    # -- the state machine ----------------------------------------------------------------------
    def open(self, icon: Icon) -> Window:
        rng = random.Random(self.seed * 7919 + self.opened)
        self.opened += 1
        n = len(icon.fields)
        need_h = TITLE_H + PAD + n * (FIELD_H + PAD) + BUTTON_H + 2 * PAD
        w = rng.randint(min(300, self.width - 8), min(420, self.width - 8))
        h = rng.randint(need_h, max(need_h, min(need_h + 80, self.height - 8)))
        x = rng.randint(4, self.width - w - 4)
        y = rng.randint(4, max(4, self.height - h - 4))
        fields, fy = {}, y + TITLE_H + PAD
        for name in icon.fields:
            fields[name] = (x + 90, fy, x + w - PAD, fy + FIELD_H)
            fy += FIELD_H + PAD
        by = y + h - PAD - BUTTON_H
        ok = (x + w - 2 * (BUTTON_W + PAD), by, x + w - BUTTON_W - 2 * PAD, by + BUTTON_H)
        cancel = (x + w - BUTTON_W - PAD, by, x + w - PAD, by + BUTTON_H)
        close = (x + w - TITLE_H + 3, y + 3, x + w - 3, y + TITLE_H - 3)
        self.window = Window(icon.app, (x, y, x + w, y + h), icon.color, fields,
                             dict.fromkeys(icon.fields, ""), close, ok, cancel)
        return self.window

    def click(self, x: int, y: int) -> Event:
        win = self.window
        if win is None:
            hit = next((i for i in self.icons if inside(i.box, x, y)), None)
            if hit is None:
                return Event("nothing", detail="no icon there")
            self.open(hit)
            return Event("opened", hit.app)
        if not inside(win.box, x, y):
            return Event("nothing", win.app, f"the {win.app} window is open; close it first")
        if inside(win.close, x, y) or inside(win.cancel, x, y):
            self.window = None
            return Event("closed", win.app)
        if inside(win.ok, x, y):
            self.window = None
            return Event("submitted", win.app, values=tuple(win.values.items()))
        hit_field = next((f for f, b in win.fields.items() if inside(b, x, y)), "")
        if hit_field:
            win.focus = hit_field
            return Event("focused", win.app, hit_field)
        return Event("nothing", win.app, "nothing to click there")

    def type(self, text: str) -> Event:
        win = self.window
        if win is None or not win.focus:
            return Event("nothing", detail="no text field has focus; click one first")
        win.values[win.focus] = text
        return Event("typed", win.app, win.focus)

    # -- rendering -------------------------------------------------------------------------------
    def render(self) -> Any:
        """The screen as a PIL RGB image (deterministic for the same state)."""
        from PIL import Image as PILImage
        from PIL import ImageDraw

        im = PILImage.new("RGB", (self.width, self.height), self.background)
        d = ImageDraw.Draw(im)
        for icon in self.icons:
            self._draw_icon(d, icon)
        if self.window is not None:
            self._draw_window(d, self.window)
        return im

    def _draw_icon(self, d: Any, icon: Icon) -> None:
        sq = icon.square
        side = sq[2] - sq[0]
        d.rounded_rectangle(sq, radius=max(3, side // 6), fill=icon.color)
        d.text(center(sq), icon.app[0], fill=(255, 255, 255), font=_font(max(10, side // 2)),
               anchor="mm")
        d.text(((icon.box[0] + icon.box[2]) // 2, sq[3] + 2), icon.app, fill=(20, 20, 20),
               font=_font(11), anchor="ma")

    def _draw_window(self, d: Any, win: Window) -> None:
        x0, y0, x1, y1 = win.box
        d.rectangle((x0 + 4, y0 + 4, x1 + 4, y1 + 4), fill=(90, 90, 90))  # shadow
        d.rectangle(win.box, fill=(246, 245, 244), outline=(60, 60, 60))
        d.rectangle((x0, y0, x1 - 1, y0 + TITLE_H), fill=win.color)
        d.text((x0 + 8, y0 + TITLE_H // 2), win.app, fill=(255, 255, 255), font=_font(13),
               anchor="lm")
        d.rectangle(win.close, fill=(200, 40, 40))
        d.text(center(win.close), "x", fill=(255, 255, 255), font=_font(12), anchor="mm")
        for name, box in win.fields.items():
            d.text((x0 + PAD, (box[1] + box[3]) // 2), name, fill=(30, 30, 30), font=_font(12),
                   anchor="lm")
            focused = name == win.focus
            d.rectangle(box, fill=(255, 255, 255), outline=(40, 110, 220) if focused
                        else (150, 150, 150), width=2 if focused else 1)
            d.text((box[0] + 4, (box[1] + box[3]) // 2), win.values[name] + ("|" if focused
                                                                           else ""),
                   fill=(0, 0, 0), font=_font(12), anchor="lm")
        for label, box, fill in (("OK", win.ok, (40, 110, 220)),
                                 ("Cancel", win.cancel, (180, 180, 180))):
            d.rounded_rectangle(box, radius=4, fill=fill)
            d.text(center(box), label, fill=(255, 255, 255) if label == "OK" else (20, 20, 20),
                   font=_font(12), anchor="mm")


def _overlap(a: Box, b: Box, margin: int) -> bool:
    return not (a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1]
                or b[3] + margin <= a[1])


@functools.lru_cache(maxsize=32)
def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)
