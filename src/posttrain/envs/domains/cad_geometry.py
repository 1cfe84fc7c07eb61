"""Geometry for `cad.modeling`'s grader: triangle meshes read from untrusted bytes, voxelisation by ray
parity, volume IoU, Chamfer distance and the orthographic renders of the feedback. Pure numpy, run in the
trusted process (the mesh comes out of the sandbox; nothing here imports CadQuery).

Normalisations. `iou` (the reward) centres both meshes on their bounding-box centres and keeps
millimetres: the briefs give dimensions, so a part at the wrong size must not score 1, while where the
script puts the part is not graded. `iou_unit` and `chamfer` use CAD-Recode's evaluation normalisation:
each mesh centred on its bounding box and scaled so that its longest side is 1 (unit cube); `chamfer` is
their definition (mean squared nearest-neighbour distance in both directions, summed; CAD-Recode
reports it x1000), on `CHAMFER_POINTS` area-weighted surface samples per mesh instead of their 8192.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TRIANGLES = 200_000
MAX_COORD = 1e6  # mm; a part beyond a kilometre is not a part
VOXELS = 64  # along the target's longest side ...
MIN_VOXELS_ACROSS = 8  # ... and at least this many across its thinnest (a 4 mm plate is not 3 voxels)
MAX_VOXELS_PER_AXIS = 160
MAX_CANDIDATES = 2_000_000  # (column, triangle) pairs voxelised per chunk
MAX_TOTAL_CANDIDATES = 40_000_000  # a mesh needing more is refused (huge overlapping triangles)
CHAMFER_POINTS = 2048
# Rays pass a hair off the column centres so they never run exactly along a shared triangle edge.
RAY_JITTER = np.array([0.000_618_034, 0.000_414_214])


class MeshError(ValueError):
    """Mesh bytes that do not describe a usable triangle mesh; the message says what is wrong."""


@dataclass(frozen=True)
class Mesh:
    vertices: np.ndarray  # (V, 3) float64, mm
    triangles: np.ndarray  # (T, 3) int64 indices into vertices

    @property
    def corners(self) -> np.ndarray:
        """(T, 3, 3): each triangle's three vertices."""
        return self.vertices[self.triangles]

    @property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self.vertices.min(axis=0), self.vertices.max(axis=0)

    @property
    def extent(self) -> np.ndarray:
        lo, hi = self.bounds
        return hi - lo

    @property
    def centre(self) -> np.ndarray:
        lo, hi = self.bounds
        return (lo + hi) / 2

    def moved(self, offset: np.ndarray | tuple[float, float, float], scale: float = 1.0) -> Mesh:
        """The mesh translated by `offset`, then scaled about the origin."""
        return Mesh((self.vertices + np.asarray(offset, dtype=np.float64)) * scale, self.triangles)


def box_mesh(size: tuple[float, float, float], centre: tuple[float, float, float] = (0, 0, 0)) -> Mesh:
    """An axis-aligned box (12 outward-facing triangles): a reference shape for tests and benchmarks."""
    sx, sy, sz = (s / 2 for s in size)
    v = np.array(
        [[x, y, z] for x in (-sx, sx) for y in (-sy, sy) for z in (-sz, sz)], dtype=np.float64
    ) + np.asarray(centre, dtype=np.float64)
    quads = [(0, 1, 3, 2), (4, 6, 7, 5), (0, 4, 5, 1), (2, 3, 7, 6), (0, 2, 6, 4), (1, 5, 7, 3)]
    tris = [t for a, b, c, d in quads for t in ((a, b, c), (a, c, d))]
    return Mesh(v, np.array(tris, dtype=np.int64))


def parse_mesh(vertex_bytes: bytes, triangle_bytes: bytes) -> Mesh:
    """A mesh from little-endian float32 xyz triples and int32 index triples; MeshError names the flaw."""
    if len(vertex_bytes) % 12 or len(triangle_bytes) % 12:
        raise MeshError("mesh files are not whole float32/int32 triples")
    vertices = np.frombuffer(vertex_bytes, dtype="<f4").reshape(-1, 3).astype(np.float64)
    triangles = np.frombuffer(triangle_bytes, dtype="<i4").reshape(-1, 3).astype(np.int64)
    if len(triangles) == 0 or len(vertices) < 3:
        raise MeshError("the mesh has no triangles")
    if len(triangles) > MAX_TRIANGLES:
        raise MeshError(f"the mesh has {len(triangles)} triangles; the limit is {MAX_TRIANGLES}")
    if not np.isfinite(vertices).all() or np.abs(vertices).max() > MAX_COORD:
        raise MeshError(f"the mesh has non-finite coordinates or coordinates beyond {MAX_COORD:g} mm")
    if triangles.min() < 0 or triangles.max() >= len(vertices):
        raise MeshError("the mesh has triangle indices outside its vertex list")
    return Mesh(vertices, triangles)


def mesh_volume(mesh: Mesh) -> float:
    """Enclosed volume (mm^3) by the divergence theorem; exact for a closed, consistently oriented mesh."""
    c = mesh.corners
    return float(abs(np.einsum("ij,ij->i", c[:, 0], np.cross(c[:, 1], c[:, 2])).sum()) / 6.0)


def is_watertight(mesh: Mesh, weld: float = 1e-6) -> bool:
    """Every edge shared by exactly two triangles, after welding vertices closer than `weld` x the size.

    CadQuery tessellates face by face, so a closed solid's mesh repeats the vertices of shared edges."""
    scale = max(float(mesh.extent.max()), 1e-9)
    keys = np.round(mesh.vertices / (scale * weld)).astype(np.int64)
    _, welded = np.unique(keys, axis=0, return_inverse=True)
    tri = welded.reshape(-1)[mesh.triangles]
    tri = tri[(tri[:, 0] != tri[:, 1]) & (tri[:, 1] != tri[:, 2]) & (tri[:, 0] != tri[:, 2])]
    if len(tri) == 0:
        return False
    edges = np.sort(np.concatenate([tri[:, [0, 1]], tri[:, [1, 2]], tri[:, [2, 0]]]), axis=1)
    _, counts = np.unique(edges, axis=0, return_counts=True)
    return bool((counts == 2).all())


@dataclass(frozen=True)
class Grid:
    """A voxel grid: `origin` is the low corner, `pitch` the voxel side (mm), `shape` voxels per axis."""

    origin: np.ndarray
    pitch: float
    shape: tuple[int, int, int]

    @property
    def voxel_volume(self) -> float:
        return self.pitch**3


def grid_around(lo: np.ndarray, hi: np.ndarray, pitch: float) -> Grid:
    """The grid of voxels of side `pitch` covering [lo, hi], coarsened (pitch grows) until no axis has
    more than MAX_VOXELS_PER_AXIS voxels."""
    span = np.maximum(hi - lo, pitch)
    pitch = max(pitch, float(span.max()) / MAX_VOXELS_PER_AXIS)
    shape = tuple(int(max(1, np.ceil(s / pitch - 1e-9))) for s in span)
    return Grid(np.asarray(lo, dtype=np.float64), pitch, shape)  # type: ignore[arg-type]


def voxelize(mesh: Mesh, grid: Grid) -> np.ndarray:
    """Boolean occupancy (shape `grid.shape`) of voxel centres inside the mesh, by the parity of rays cast
    along the grid's longest axis (the fewest ray-triangle candidates), one per voxel column. Exact for a
    closed mesh; an open mesh gives what parity gives. MeshError when the mesh is too costly to voxelise
    (triangles far larger than the part)."""
    axis = int(np.argmax(grid.shape))
    order = [a for a in range(3) if a != axis] + [axis]
    nx, ny, nz = (grid.shape[a] for a in order)
    origin = grid.origin[order]
    p = grid.pitch
    c = mesh.corners[:, :, order]
    x, y, z = c[:, :, 0], c[:, :, 1], c[:, :, 2]
    # Each triangle's barycentric weights and height as affine functions of the ray's (x, y):
    # w = a*x + b*y + k. Triangles seen edge-on (no projected area) never cross a ray.
    area2 = (x[:, 1] - x[:, 0]) * (y[:, 2] - y[:, 0]) - (x[:, 2] - x[:, 0]) * (y[:, 1] - y[:, 0])
    keep = np.abs(area2) > 1e-12 * max(float(mesh.extent.max()), 1e-9) ** 2
    x, y, z, area2 = x[keep], y[keep], z[keep], area2[keep]
    coef = []
    for i, j in ((1, 2), (2, 0)):
        a = (y[:, i] - y[:, j]) / area2
        b = (x[:, j] - x[:, i]) / area2
        coef.append((a, b, (x[:, i] * y[:, j] - x[:, j] * y[:, i]) / area2))
    (a1, b1, k1), (a2, b2, k2) = coef
    za = a1 * (z[:, 0] - z[:, 2]) + a2 * (z[:, 1] - z[:, 2])
    zb = b1 * (z[:, 0] - z[:, 2]) + b2 * (z[:, 1] - z[:, 2])
    zk = k1 * (z[:, 0] - z[:, 2]) + k2 * (z[:, 1] - z[:, 2]) + z[:, 2]
    jx, jy = RAY_JITTER * p
    gx0, gy0 = origin[0] + 0.5 * p + jx, origin[1] + 0.5 * p + jy
    i0 = np.clip(np.ceil((x.min(axis=1) - gx0) / p), 0, nx).astype(np.int64)
    i1 = np.clip(np.floor((x.max(axis=1) - gx0) / p), -1, nx - 1).astype(np.int64)
    j0 = np.clip(np.ceil((y.min(axis=1) - gy0) / p), 0, ny).astype(np.int64)
    j1 = np.clip(np.floor((y.max(axis=1) - gy0) / p), -1, ny - 1).astype(np.int64)
    wi, wj = np.maximum(i1 - i0 + 1, 0), np.maximum(j1 - j0 + 1, 0)
    counts = wi * wj
    total = int(counts.sum())
    if total > MAX_TOTAL_CANDIDATES:
        raise MeshError(f"the mesh is too costly to voxelise ({total} ray-triangle candidates)")
    hits = np.zeros(nx * ny * (nz + 1), dtype=np.int64)
    bounds = np.cumsum(counts)
    start = 0
    while start < len(x):
        # the longest run of triangles whose candidates fit in one chunk (at least one triangle)
        base = bounds[start - 1] if start else 0
        stop = max(start + 1, int(np.searchsorted(bounds, base + MAX_CANDIDATES, side="right")))
        n = counts[start:stop]
        if n.sum():
            tri = np.repeat(np.arange(start, stop), n)
            local = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            ii = i0[tri] + local % wi[tri]
            jj = j0[tri] + local // wi[tri]
            px, py = gx0 + ii * p, gy0 + jj * p
            w1 = a1[tri] * px + b1[tri] * py + k1[tri]
            w2 = a2[tri] * px + b2[tri] * py + k2[tri]
            inside = (w1 >= 0) & (w2 >= 0) & (w1 + w2 <= 1)
            tri, ii, jj, px, py = tri[inside], ii[inside], jj[inside], px[inside], py[inside]
            zh = za[tri] * px + zb[tri] * py + zk[tri]
            # index of the first voxel centre above the hit: its parity flips from there up
            k = np.clip(np.floor((zh - origin[2]) / p - 0.5) + 1, 0, nz).astype(np.int64)
            hits += np.bincount((ii * ny + jj) * (nz + 1) + k, minlength=len(hits))
        start = stop
    crossings = np.cumsum(hits.reshape(nx * ny, nz + 1)[:, :nz], axis=1)
    occupied = (crossings % 2 == 1).reshape(nx, ny, nz)
    return np.transpose(occupied, np.argsort(order))


def target_pitch(target: Mesh, voxels: int = VOXELS) -> float:
    """The voxel side for comparisons with `target`: its longest side / `voxels` or its thinnest side /
    MIN_VOXELS_ACROSS, whichever is finer."""
    ext = np.maximum(target.extent, 1e-9)
    return min(float(ext.max()) / voxels, float(ext.min()) / MIN_VOXELS_ACROSS)


def voxels_of(mesh: Mesh) -> np.ndarray:
    """The mesh alone, centred, on the grid a comparison with it as the target would use."""
    m = mesh.moved(-mesh.centre)
    return voxelize(m, grid_around(m.bounds[0], m.bounds[1], target_pitch(m)))


@dataclass(frozen=True)
class Comparison:
    """A produced part against its target on one shared grid (both centred on their bounding boxes)."""

    iou: float
    target_voxels: np.ndarray
    produced_voxels: np.ndarray
    grid: Grid


def compare(target: Mesh, produced: Mesh, voxels: int = VOXELS, centre: bool = True) -> Comparison:
    """Volume IoU of the two meshes, voxelised on one grid of `target_pitch` (coarsened where the pair
    would need more than MAX_VOXELS_PER_AXIS). `centre`: move each mesh's bounding-box centre to the origin first (the reward's
    normalisation); without it the meshes are compared where they are."""
    if centre:
        target, produced = target.moved(-target.centre), produced.moved(-produced.centre)
    lo = np.minimum(target.bounds[0], produced.bounds[0])
    hi = np.maximum(target.bounds[1], produced.bounds[1])
    grid = grid_around(lo, hi, target_pitch(target, voxels))
    a, b = voxelize(target, grid), voxelize(produced, grid)
    return Comparison(iou_of(a, b), a, b, grid)


def unit_normalised(mesh: Mesh) -> Mesh:
    """CAD-Recode's normalisation: centred on the bounding box, longest side scaled to 1."""
    return mesh.moved(-mesh.centre, 1.0 / max(float(mesh.extent.max()), 1e-12))


# CAD-Recode-normalised meshes all fit the unit cube, so one fixed grid serves every pair (and a
# target's voxels can be kept).
UNIT_GRID = Grid(np.full(3, -0.5), 1.0 / VOXELS, (VOXELS, VOXELS, VOXELS))


def unit_voxels(mesh: Mesh) -> np.ndarray:
    return voxelize(unit_normalised(mesh), UNIT_GRID)


def iou_of(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two occupancy grids of one shape (0 when both are empty)."""
    union = int(np.count_nonzero(a | b))
    return int(np.count_nonzero(a & b)) / union if union else 0.0


def iou_unit(target: Mesh, produced: Mesh) -> float:
    """Volume IoU after CAD-Recode's normalisation of each mesh (scale-invariant)."""
    return iou_of(unit_voxels(target), unit_voxels(produced))


def sample_surface(mesh: Mesh, n: int, seed: int = 0) -> np.ndarray:
    """`n` points drawn uniformly over the mesh's surface (area-weighted triangles, uniform inside)."""
    c = mesh.corners
    area = 0.5 * np.linalg.norm(np.cross(c[:, 1] - c[:, 0], c[:, 2] - c[:, 0]), axis=1)
    total = float(area.sum())
    if total <= 0:
        return np.repeat(c[:1, 0], n, axis=0)
    rng = np.random.default_rng(seed)
    tri = rng.choice(len(c), size=n, p=area / total)
    u, v = rng.random(n), rng.random(n)
    flip = u + v > 1
    u[flip], v[flip] = 1 - u[flip], 1 - v[flip]
    t = c[tri]
    return t[:, 0] + u[:, None] * (t[:, 1] - t[:, 0]) + v[:, None] * (t[:, 2] - t[:, 0])


def unit_points(mesh: Mesh, n: int = CHAMFER_POINTS) -> np.ndarray:
    """The Chamfer distance's samples of a mesh: `n` surface points of its unit-normalised copy, drawn
    with the same seed for every mesh (so a mesh against itself gives exactly 0)."""
    return sample_surface(unit_normalised(mesh), n, seed=0)


def chamfer_of(a: np.ndarray, b: np.ndarray) -> float:
    """CAD-Recode's Chamfer distance between two point sets: mean squared nearest-neighbour distance
    from each to the other, summed."""
    from scipy.spatial import cKDTree  # scipy comes with the cad extra (CadQuery needs it)

    d_ab, _ = cKDTree(b).query(a, k=1)
    d_ba, _ = cKDTree(a).query(b, k=1)
    return float(np.mean(d_ab**2) + np.mean(d_ba**2))


def chamfer(target: Mesh, produced: Mesh) -> float:
    """CAD-Recode's Chamfer distance between the unit-normalised meshes (lower is better; 0 = same)."""
    return chamfer_of(unit_points(target), unit_points(produced))


# ---- renders ----------------------------------------------------------------------------------------
PANEL_PX = 112
GUTTER_PX = 6
LABEL_W_PX = 52
HEADER_H_PX = 16
VIEWS = ("top", "front", "side")
ROWS = ("target", "yours", "overlap")
BACKGROUND = 255
FRAME = 215
OVERLAP_COLOURS = {"both": (150, 150, 150), "yours": (220, 50, 40), "target": (40, 90, 220)}


def _view(vox: np.ndarray, view: str) -> tuple[np.ndarray, np.ndarray]:
    """(occupied, nearness in [0, 1]) images of one orthographic view: top looks down -z (x right, y
    up), front looks along +y (x right, z up), side looks along -x (y right, z up)."""
    if view == "top":
        v = vox[:, :, ::-1]  # first voxel met from above
        img_axes = (1, 0)  # rows = y, cols = x
    elif view == "front":
        v = np.transpose(vox, (0, 2, 1))  # (x, z, y): depth along +y
        img_axes = (1, 0)
    else:
        v = np.transpose(vox[::-1], (1, 2, 0))  # (y, z, x from +x): depth along -x
        img_axes = (1, 0)
    hit = v.any(axis=2)
    depth = np.argmax(v, axis=2)
    near = np.where(hit, 1.0 - depth / max(1, v.shape[2] - 1), 0.0)
    hit, near = np.transpose(hit, img_axes)[::-1], np.transpose(near, img_axes)[::-1]
    return hit, near


def _fit(img: np.ndarray, scale: float) -> np.ndarray:
    """Nearest-neighbour resize of a 2-D or HxWx3 array by `scale`, centred on a PANEL_PX square."""
    h, w = img.shape[:2]
    nh, nw = max(1, int(round(h * scale))), max(1, int(round(w * scale)))
    rows = np.minimum((np.arange(nh) / scale).astype(int), h - 1)
    cols = np.minimum((np.arange(nw) / scale).astype(int), w - 1)
    out = np.full((PANEL_PX, PANEL_PX, 3), BACKGROUND, dtype=np.uint8)
    small = img[rows][:, cols]
    top, left = (PANEL_PX - nh) // 2, (PANEL_PX - nw) // 2
    out[top : top + nh, left : left + nw] = small
    return out


def render_comparison(target: np.ndarray, produced: np.ndarray | None) -> np.ndarray:
    """An RGB image (uint8) of three orthographic views (columns: top, front, side) of the target, the
    produced part and their overlap (rows), depth-shaded, on one scale. `produced` None: that row and
    the overlap show the target only."""
    from PIL import Image, ImageDraw

    shape = np.array(target.shape)
    scale = (PANEL_PX - 4) / max(1, int(shape.max()))
    width = LABEL_W_PX + len(VIEWS) * (PANEL_PX + GUTTER_PX)
    height = HEADER_H_PX + len(ROWS) * (PANEL_PX + GUTTER_PX)
    canvas = np.full((height, width, 3), BACKGROUND, dtype=np.uint8)
    empty = np.zeros_like(target)
    for col, view in enumerate(VIEWS):
        t_hit, t_near = _view(target, view)
        p_hit, p_near = _view(produced if produced is not None else empty, view)
        shaded = []
        for hit, near, tint in ((t_hit, t_near, (0.55, 0.7, 1.0)), (p_hit, p_near, (1.0, 0.7, 0.5))):
            level = 60 + 170 * near
            rgb = np.stack([level * k for k in tint], axis=-1)
            shaded.append(np.where(hit[..., None], rgb, BACKGROUND).astype(np.uint8))
        overlap = np.full(t_hit.shape + (3,), BACKGROUND, dtype=np.uint8)
        overlap[t_hit & p_hit] = OVERLAP_COLOURS["both"]
        overlap[p_hit & ~t_hit] = OVERLAP_COLOURS["yours"]
        overlap[t_hit & ~p_hit] = OVERLAP_COLOURS["target"]
        x = LABEL_W_PX + col * (PANEL_PX + GUTTER_PX)
        for row, img in enumerate((*shaded, overlap)):
            y = HEADER_H_PX + row * (PANEL_PX + GUTTER_PX)
            panel = _fit(img, scale)
            panel[[0, -1], :] = FRAME
            panel[:, [0, -1]] = FRAME
            canvas[y : y + PANEL_PX, x : x + PANEL_PX] = panel
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    for col, view in enumerate(VIEWS):
        draw.text((LABEL_W_PX + col * (PANEL_PX + GUTTER_PX) + 4, 2), view, fill=(0, 0, 0))
    for row, name in enumerate(ROWS):
        draw.text((4, HEADER_H_PX + row * (PANEL_PX + GUTTER_PX) + PANEL_PX // 2 - 6), name, fill=(0, 0, 0))
    return np.asarray(image)


RENDER_CAPTION = (
    "rows: target, your part, overlap (grey both, red only yours, blue only the target); "
    "columns: top view (looking down z), front (looking along +y), side (looking along -x); "
    "nearer surfaces are lighter"
)
