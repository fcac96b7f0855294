"""Pascal VOC folders as people label them, read and checked whole, as the COCO dictionary the
rest of detection reads (``coco.make_split``): one format for training, scoring and the report.

    torchvision's VOC layout           labelImg's flat layout (CVAT's VOC export too)
    DIR/Annotations/<stem>.xml         DIR/annotations/<stem>.xml
    DIR/JPEGImages/<stem>.jpg          DIR/images/<stem>.<jpg|png|...>
    DIR/ImageSets/Main/<split>.txt     DIR/<split>.txt            (one stem a line)

Class names come from the XML files, sorted: category ``k + 1`` is the ``k``-th name of every
split together, so every run of a folder numbers them alike. What is legal but odd is handled
as VOC's evaluation and torchvision's references do and counted per split: ``difficult`` objects
are ignored in training and scoring (COCO's crowd regions: a detection on one counts neither
way), boxes beyond the image are clamped, an XML ``<size>`` that disagrees with the image gives
way to the image, images without objects are kept for scoring, and boxes drawn on an image's
stored pixels are turned with it when its EXIF orientation turns it upright. What is broken
raises a ``UsageError`` naming the file and what is wrong, before anything is written.

XML from strangers: the standard library's parser (expat) resolves no external entity; a file
with a document type declaration (where entities are declared) is refused before parsing, so no
entity is ever expanded, and files over ``MAX_XML_BYTES`` are refused unread.

References: the VOC development kit (``difficult``; 1-based pixel coordinates, kept as written,
as torchvision's ``VOCDetection`` keeps them); labelImg's and CVAT's exports.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ...training.errors import UsageError
from ..images import IMAGE_SUFFIXES

MAX_XML_BYTES = 1 << 20  # an annotation file is a few kilobytes
LAYOUTS = {"voc": ("Annotations", "JPEGImages", "ImageSets/Main"), "flat": ("annotations", "images", ".")}


def find_layout(root: Path) -> tuple[Path, Path, Path] | None:
    """``(annotations, images, lists)`` folders of a VOC folder in either layout, or None."""
    for ann, images, lists in LAYOUTS.values():
        if (root / ann).is_dir() and (root / images).is_dir():
            return root / ann, root / images, (root / lists).resolve()
    return None


def read_stems(lists: Path, split: str) -> list[str]:
    """The image stems of ``<split>.txt``, in order, each once."""
    path = lists / f"{split}.txt"
    if not path.is_file():
        raise UsageError(f"{path}: no list of the {split!r} split (one image stem a line)")
    stems = [line.split()[0] for line in path.read_text(encoding="utf-8", errors="strict").splitlines()
             if line.strip()]
    if not stems:
        raise UsageError(f"{path}: the {split!r} split lists no image")
    twice = sorted({s for s in stems if stems.count(s) > 1}) if len(set(stems)) != len(stems) else []
    if twice:
        raise UsageError(f"{path}: {twice[0]} is listed twice")
    return stems


def parse_xml(path: Path) -> ET.Element:
    """One annotation file, parsed safely (no document type, so no entity), or a UsageError."""
    if not path.is_file():
        raise UsageError(f"{path}: the annotation file of a listed image is missing")
    if path.stat().st_size > MAX_XML_BYTES:
        raise UsageError(f"{path}: {path.stat().st_size:,} bytes, more than an annotation file holds "
                         f"({MAX_XML_BYTES:,}); refused unread")
    text = path.read_bytes()
    if b"<!DOCTYPE" in text or b"<!ENTITY" in text:
        raise UsageError(f"{path}: declares a document type or entities; annotation files have none, and they are "
                         "not expanded here")
    try:
        return ET.fromstring(text)
    except ET.ParseError as e:
        raise UsageError(f"{path}: not well-formed XML ({e}); a cut or damaged file") from None


def _number(node: ET.Element, tag: str, path: Path, what: str) -> float:
    child = node.find(tag)
    if child is None or child.text is None or not child.text.strip():
        raise UsageError(f"{path}: {what} has no <{tag}>")
    try:
        v = float(child.text)
    except ValueError:
        raise UsageError(f"{path}: {what}'s <{tag}> is {child.text.strip()!r}, not a number") from None
    if not math.isfinite(v):
        raise UsageError(f"{path}: {what}'s <{tag}> is {child.text.strip()!r}, not a finite number")
    return v


def image_of(images: Path, stem: str, xml_name: str | None) -> Path:
    """The image file of a stem: the XML's ``<filename>`` when it is in the image folder, else
    ``<stem>`` with an image suffix."""
    if xml_name and (images / Path(xml_name).name).is_file():
        return images / Path(xml_name).name
    for suffix in IMAGE_SUFFIXES:
        for candidate in (images / f"{stem}{suffix}", images / f"{stem}{suffix.upper()}"):
            if candidate.is_file():
                return candidate
    raise UsageError(f"{images}: no image for the listed stem {stem!r} (expected {stem}.jpg or another of "
                     f"{', '.join(IMAGE_SUFFIXES)})")


def upright(box: tuple[float, float, float, float], orientation: int, w: int, h: int
            ) -> tuple[float, float, float, float]:
    """A box drawn on an image's stored ``w x h`` pixels, in the pixels of the image turned upright
    by its EXIF ``orientation`` (what ``read_image`` returns)."""
    x0, y0, x1, y1 = box
    corners = [(x0, y0), (x1, y1)]
    turn = {2: lambda x, y: (w - x, y), 3: lambda x, y: (w - x, h - y), 4: lambda x, y: (x, h - y),
            5: lambda x, y: (y, x), 6: lambda x, y: (h - y, x), 7: lambda x, y: (h - y, w - x),
            8: lambda x, y: (y, w - x)}.get(orientation, lambda x, y: (x, y))
    (a, b), (c, d) = (turn(x, y) for x, y in corners)
    return min(a, c), min(b, d), max(a, c), max(b, d)


def check_voc(root: Path, split: str, names: dict[str, int] | None = None) -> tuple[dict, Path, dict[str, int]]:
    """A split of a VOC folder read and checked whole: ``(COCO dict, image folder, odd counts)``.
    ``names`` maps class names to category ids (default: this split's names, sorted)."""
    from PIL import Image, UnidentifiedImageError

    layout = find_layout(root)
    if layout is None:
        raise UsageError(f"--data-dir {root}: not a VOC folder (expected Annotations/ and JPEGImages/ with "
                         "ImageSets/Main/<split>.txt, or annotations/, images/ and <split>.txt)")
    ann_dir, images, lists = layout
    stems = read_stems(lists, split)
    odd = dict(difficult=0, clamped=0, size_disagrees=0, images_without_objects=0, exif_turned=0)
    records = []
    for stem in stems:
        path = ann_dir / f"{stem}.xml"
        xml = parse_xml(path)
        image = image_of(images, stem, xml.findtext("filename"))
        try:
            with Image.open(image) as f:
                raw_w, raw_h, mode = f.size[0], f.size[1], f.mode
                orientation = f.getexif().get(0x0112, 1)
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise UsageError(f"{image}: not an image that opens ({e})") from None
        if mode.startswith(("I", "F")):
            raise UsageError(f"{image}: {mode} samples; expected 8-bit images (RGB, grey or palette)")
        w, h = (raw_h, raw_w) if orientation in (5, 6, 7, 8) else (raw_w, raw_h)
        size = xml.find("size")
        stated = None
        if size is not None and size.findtext("width") and size.findtext("height"):
            stated = (round(_number(size, "width", path, "<size>")), round(_number(size, "height", path, "<size>")))
        turned = orientation not in (1, None) and stated == (raw_w, raw_h) and stated != (w, h)
        if stated is not None and stated not in ((w, h), (raw_w, raw_h)):
            odd["size_disagrees"] += 1
        objects = []
        for k, obj in enumerate(xml.findall("object")):
            what = f"object {k + 1}"
            name = (obj.findtext("name") or "").strip()
            if not name:
                raise UsageError(f"{path}: {what} has no <name>")
            box_node = obj.find("bndbox")
            if box_node is None:
                raise UsageError(f"{path}: {what} ({name}) has no <bndbox>")
            box = tuple(_number(box_node, t, path, f"{what} ({name})") for t in ("xmin", "ymin", "xmax", "ymax"))
            if box[2] <= box[0] or box[3] <= box[1]:
                raise UsageError(f"{path}: {what} ({name}) has an inverted or empty box {box}: xmax must exceed "
                                 "xmin and ymax ymin")
            if turned:
                box = upright(box, orientation, raw_w, raw_h)
            clamped = (max(box[0], 0.0), max(box[1], 0.0), min(box[2], float(w)), min(box[3], float(h)))
            if clamped != box:
                odd["clamped"] += 1
            if clamped[2] - clamped[0] < 1 or clamped[3] - clamped[1] < 1:
                raise UsageError(f"{path}: {what} ({name}) lies outside its {w}x{h} image: {box}")
            difficult = (obj.findtext("difficult") or "0").strip() == "1"
            odd["difficult"] += difficult
            objects.append((name, clamped, difficult))
        odd["exif_turned"] += bool(turned and objects)
        odd["images_without_objects"] += not objects
        records.append((stem, image.name, w, h, objects))
    names = names or {n: k + 1 for k, n in enumerate(sorted({o[0] for r in records for o in r[4]}))}
    unknown = sorted({o[0] for r in records for o in r[4]} - set(names))
    if unknown:
        raise UsageError(f"{ann_dir}: the {split!r} split names classes the other splits do not: {unknown}")
    data: dict[str, Any] = {"images": [], "annotations": [],
                            "categories": [{"id": i, "name": n} for n, i in sorted(names.items(), key=lambda t: t[1])]}
    for image_id, (stem, file_name, w, h, objects) in enumerate(records, start=1):
        data["images"].append({"id": image_id, "file_name": file_name, "width": w, "height": h, "stem": stem})
        for name, (x0, y0, x1, y1), difficult in objects:
            data["annotations"].append({"id": len(data["annotations"]) + 1, "image_id": image_id,
                                        "category_id": names[name], "bbox": [x0, y0, x1 - x0, y1 - y0],
                                        "area": (x1 - x0) * (y1 - y0), "iscrowd": int(difficult)})
    return data, images, odd


def class_names(root: Path, splits: list[str]) -> dict[str, int]:
    """Every split's class names together, sorted, numbered from 1: one numbering per folder."""
    layout = find_layout(root)
    if layout is None:
        return {}
    names: set[str] = set()
    for split in splits:
        for stem in read_stems(layout[2], split):
            xml = parse_xml(layout[0] / f"{stem}.xml")
            names |= {(o.findtext("name") or "").strip() for o in xml.findall("object")} - {""}
    return {n: k + 1 for k, n in enumerate(sorted(names))}
