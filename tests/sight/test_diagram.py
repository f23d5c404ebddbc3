"""Diagrams of block graphs (fused, unfused, one rank's), their SVG and text forms, Model Explorer's files, the CLI."""

import contextlib
import io
import json
import os
import tempfile
import unittest
import xml.etree.ElementTree as ET
from unittest import mock

import torch
from diffusers import Flux2Transformer2DModel

import surgery
from surgery.core.walk import find_modules
from flux2_testing import build, small_config
from surgery_rewrites.flux2 import VARIANTS, example_inputs
from surgery.sight import diagram, forms, svg
from surgery.sight.graph import block_graph
from surgery.app.cli import main
from surgery.core.build import default_dtype
import page_width as PW

try:
    import model_explorer  # noqa: F401
except ImportError:
    model_explorer = None


def projections(graph):
    return {n.label: n for n in graph.nodes if n.kind == "projection"}


# klein-9B at full width (32 heads x 128, hidden 4096, MLP 12288) with one block of each kind: per-block graphs and
# per-rank shapes are those of the real model, at a fraction of the planning time.
KLEIN9B_WIDTH = dict(VARIANTS["klein-9b"], num_layers=1, num_single_layers=1)


def klein9b():
    with torch.device("meta"), default_dtype(torch.bfloat16):
        model = Flux2Transformer2DModel(**KLEIN9B_WIDTH)
    inputs = example_inputs(KLEIN9B_WIDTH, image_tokens=256, text_tokens=64, dtype=torch.bfloat16, device="meta")
    return model, inputs


_FORMS = {}


def klein9b_forms(module=None):
    """`diagram.forms` of the klein-9B-width model at TP=8, computed once per module for the whole file."""
    if module not in _FORMS:
        model, inputs = klein9b()
        _FORMS[module] = (model, inputs, dict(model.named_parameters()),
                          forms.forms(model, inputs, module=module, tp=8))
    return _FORMS[module]


class Reduction(unittest.TestCase):
    """A real (CPU) small block: what each form reduces to."""

    @classmethod
    def setUpClass(cls):
        model = build(small_config("tp_wide"))  # 8 heads x 8, dim 64, mlp hidden 160
        cls.attn = model.single_transformer_blocks[0].attn
        cls.args = (torch.randn(1, 6, 64),)
        cls.kwargs = {"image_rotary_emb": (torch.randn(6, 8), torch.randn(6, 8))}
        cls.fused = block_graph(cls.attn, cls.args, cls.kwargs, title="fused")
        cls.unfused_attn = surgery.unfuse(__import__("copy").deepcopy(cls.attn))
        cls.unfused = block_graph(cls.unfused_attn, cls.args, cls.kwargs, title="unfused")

    def test_fused_block(self):
        g = self.fused
        self.assertEqual(sorted(projections(g)), ["to_out", "to_qkv_mlp_proj"])
        self.assertTrue(all(p.sharding == "fused" for p in projections(g).values()))
        self.assertEqual(projections(g)["to_qkv_mlp_proj"].storage,
                         "fused: to_qkv_mlp_proj.q, to_qkv_mlp_proj.k, to_qkv_mlp_proj.v, to_qkv_mlp_proj.gate, "
                         "to_qkv_mlp_proj.up (5 row views)")
        self.assertIn("cat", [n.label for n in g.nodes if n.kind == "join"])
        self.assertEqual((g.count("attention"), g.count("norm"), g.count("activation"), g.count("collective")),
                         (1, 2, 1, 0))
        # the fused output projection reads the concatenation of attention and MLP: [1, 6, 64 + 160]
        cat = g.by_label("cat")
        self.assertEqual([e.shape for e in g.edges if e.src == cat.id], ["1×6×224"])

    def test_unfused_block(self):
        g = self.unfused
        p = projections(g)
        rows = [f"to_qkv_mlp_proj.{part}" for part in ("q", "k", "v", "gate", "up")]
        self.assertEqual(sorted(p), sorted(rows + ["to_out.attn_part", "to_out.mlp_part"]))
        self.assertEqual({k: v.sharding for k, v in p.items()},
                         {**{r: "colwise" for r in rows}, "to_out.attn_part": "rowwise", "to_out.mlp_part": "rowwise"})
        self.assertEqual(p["to_qkv_mlp_proj.k"].storage, "view of to_qkv_mlp_proj rows 64:128")
        self.assertEqual(p["to_out.mlp_part"].storage, "copy of to_out columns 64:224")
        # q, k, v, gate, up all read the block input (the leaf concatenates them for the stock processor); the two
        # column parts of to_out meet in one add
        inputs = [e.dst for e in g.edges if e.src == "input:hidden_states"]  # named from the forward's signature
        self.assertEqual(sorted(inputs), sorted(f"module:{k}" for k in rows))
        add = g.by_label("add")
        self.assertEqual(sorted(e.src for e in g.edges if e.dst == add.id),
                         ["module:to_out.attn_part", "module:to_out.mlp_part"])
        self.assertEqual([e.dst for e in g.edges if e.src == add.id], ["output"])

    def test_every_edge_joins_drawn_nodes(self):
        for g in (self.fused, self.unfused):
            ids = {n.id for n in g.nodes}
            self.assertTrue(all(e.src in ids and e.dst in ids and e.shape for e in g.edges), g.title)

    def test_text_fallback_without_dot(self):
        out = io.StringIO()
        with mock.patch("shutil.which", return_value=None), contextlib.redirect_stdout(out):
            diagram.show([self.fused, self.unfused])
        text = out.getvalue()
        self.assertIn("apt-get install graphviz", text)
        self.assertIn("view of to_qkv_mlp_proj rows 0:64", text)
        with mock.patch("shutil.which", return_value=None), self.assertRaises(surgery.SurgeryError):
            diagram.svg([self.fused])

    @unittest.skipUnless(diagram.dot_available(), "Graphviz's dot is not installed")
    def test_svg(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = diagram.write_svg([self.fused, self.unfused], os.path.join(tmp, "d.svg"), title="tp_wide")
            self.assertEqual(os.listdir(tmp), ["d.svg"])
            root = ET.parse(path).getroot()
        texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.text]
        self.assertIn("fused", texts)
        self.assertIn("to_qkv_mlp_proj.gate", texts)
        self.assertIn("copy of to_out", texts)  # wrapped: "copy of to_out" / "columns 0:64"
        self.assertIn("columns 0:64", texts)
        self.assertIn("1×6×224", [t.strip() for t in texts])
        # the legend names every node shape and colour drawn
        for entry in ("attention", "activation", "norm", "collective: bytes per", "colwise: output rows",
                      "fused: unfuse before"):
            self.assertIn(entry, texts)


class Forms(unittest.TestCase):
    """Full-size FLUX.2-klein-9B on meta: fused, unfused and rank 0 of 8, planned under the fake process group."""

    @classmethod
    def setUpClass(cls):
        cls.model, cls.inputs, cls.params, cls.single = klein9b_forms()
        cls.double = klein9b_forms("transformer_blocks.0")[3]

    def test_model_untouched(self):
        self.assertEqual(dict(self.model.named_parameters()), self.params)
        self.assertFalse(find_modules(self.model, fused=False))

    def test_single_block_forms(self):
        fused, unfused, rank = self.single
        self.assertEqual(fused.title, "fused single_transformer_blocks.0.attn")
        self.assertEqual([len(g.nodes) for g in self.single], [12, 19, 20])
        self.assertEqual(projections(unfused)["to_qkv_mlp_proj.q"].local, "4096 × 4096")
        self.assertEqual(projections(rank)["to_qkv_mlp_proj.q"].local, "512 × 4096")
        self.assertEqual(projections(rank)["to_out.mlp_part"].local, "4096 × 1536")
        self.assertEqual(projections(rank)["to_out.attn_part"].sharding, "rowwise")
        (collective,) = [n for n in rank.nodes if n.kind == "collective"]
        self.assertEqual(collective.label, "all_reduce (sum)")
        self.assertEqual(collective.bytes, (256 + 64) * 4096 * 2)
        add = rank.by_label("add")
        self.assertIn((add.id, collective.id), [(e.src, e.dst) for e in rank.edges])
        # rank 0's share: heads 0-3 of q, rows 0:512 of the fused weight; the MLP rows have no heads
        self.assertEqual(projections(rank)["to_qkv_mlp_proj.k"].held, "heads 0-3 of 32; rows 0:512 of 4096")
        self.assertEqual(projections(rank)["to_qkv_mlp_proj.k"].storage, "from to_qkv_mlp_proj rows 4096:4608")
        self.assertEqual(projections(rank)["to_qkv_mlp_proj.up"].held, "rows 0:1536 of 12288")
        self.assertEqual(projections(rank)["to_out.mlp_part"].held, "columns 0:1536 of 12288")
        # the two rowwise outputs, and their sum, carry partial sums up to the all-reduce, and nothing else does
        partial = {(e.src, e.dst) for e in rank.edges if e.partial}
        self.assertEqual(partial, {("module:to_out.attn_part", add.id), ("module:to_out.mlp_part", add.id),
                                   (add.id, collective.id)})
        self.assertEqual([n.label for n in rank.nodes if n.kind == "input"], ["hidden_states"])
        # the collective's traced node is the all_reduce op itself
        fx = {n.name: n for n in rank.traced.graph.nodes}
        self.assertEqual(fx[collective.fx[0]].target._opname, "all_reduce")

    def test_double_block_all_reduces(self):
        titles = [g.title for g in self.double]
        self.assertEqual(titles, ["fused transformer_blocks.0", "unfused transformer_blocks.0",
                                  "rank 0 of 8 (tensor parallel)"])
        self.assertEqual(sorted(projections(self.double[0])["ff.linear_in"].storage.split(" (")[1:]),
                         ["2 row views)"])
        rank = self.double[2]
        self.assertEqual(rank.count("collective"), 4)  # to_out, to_add_out, ff, ff_context
        p = projections(rank)
        self.assertEqual(p["attn.add_q_proj"].sharding, "colwise")
        # rank 0 holds rows 0:1536 of the gate, which are the fused linear_in's rows 0:1536; no heads in an MLP
        self.assertEqual(p["ff.linear_in.gate"].storage, "from linear_in rows 0:1536")
        self.assertEqual(p["ff.linear_in.gate"].held, "rows 0:1536 of 12288")
        self.assertEqual(p["ff.linear_in.up"].storage, "from linear_in rows 12288:13824")
        self.assertEqual(p["ff.linear_in.gate"].local, "1536 × 4096")
        self.assertEqual(p["attn.add_k_proj"].held, "heads 0-3 of 32; rows 0:512 of 4096")
        # the fused form draws the stock attention as stock (nothing shards before unfuse), not as "replicated"
        fused = projections(self.double[0])
        self.assertEqual(fused["attn.to_q"].sharding, "stock")
        self.assertEqual(fused["ff.linear_out"].sharding, "stock")
        self.assertEqual(fused["ff.linear_in"].sharding, "fused")
        # four partial sums, each ending in its own all-reduce
        partial = [e for e in rank.edges if e.partial]
        ends = {e.dst for e in partial if any(n.id == e.dst and n.kind == "collective" for n in rank.nodes)}
        self.assertEqual(len(ends), 4)
        self.assertFalse(any(e.partial for g in self.double[:2] for e in g.edges))

    def test_bad_module(self):
        with self.assertRaisesRegex(surgery.SurgeryError, "has no submodule 'nope'"):
            forms.forms(self.model, self.inputs, module="nope")


@unittest.skipIf(model_explorer is None, "ai-edge-model-explorer is not installed")
class Explorer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from surgery.sight import explore

        cls.graphs = klein9b_forms()[3]
        cls.tmp = tempfile.TemporaryDirectory()
        cls.files = explore.explorer_files(cls.graphs, cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_graph_file(self):
        with open(self.files["graphs"]) as f:
            data = json.load(f)
        graphs = data["graphCollections"][0]["graphs"]
        self.assertEqual([g["id"] for g in graphs], [g.title for g in self.graphs])
        for g in graphs:
            ids = {n["id"] for n in g["nodes"]}
            self.assertEqual(len(ids), len(g["nodes"]))
            for n in g["nodes"]:
                self.assertTrue(all(e["sourceNodeId"] in ids for e in n.get("incomingEdges", [])), n["id"])
        rank = {n["id"]: n for n in graphs[2]["nodes"]}
        self.assertEqual({n["namespace"] for n in rank.values() if n["label"] == "mm"},
                         {"to_qkv_mlp_proj/q", "to_qkv_mlp_proj/k", "to_qkv_mlp_proj/v", "to_qkv_mlp_proj/gate",
                          "to_qkv_mlp_proj/up", "to_out/attn_part", "to_out/mlp_part"})

    def overlay(self, name):
        with open(self.files["node_data"][name]) as f:
            return json.load(f)

    def test_all_reduce_overlay_names_the_collective(self):
        data = self.overlay("all-reduce bytes")
        self.assertEqual([len(data[g.title]["results"]) for g in self.graphs], [0, 0, 1])
        (node_id, result), = data["rank 0 of 8 (tensor parallel)"]["results"].items()
        with open(self.files["graphs"]) as f:
            rank = {n["id"]: n for n in json.load(f)["graphCollections"][0]["graphs"][2]["nodes"]}
        self.assertEqual(rank[node_id]["label"], "all_reduce")
        self.assertEqual(result["value"], (256 + 64) * 4096 * 2)

    def test_placement_and_bytes_overlays(self):
        placement = self.overlay("placement")["rank 0 of 8 (tensor parallel)"]["results"]
        sizes = self.overlay("bytes per rank")["rank 0 of 8 (tensor parallel)"]["results"]
        with open(self.files["graphs"]) as f:
            rank = {n["id"]: n for n in json.load(f)["graphCollections"][0]["graphs"][2]["nodes"]}
        by_layer = {rank[i]["namespace"]: r["value"] for i, r in placement.items()}
        # categories, not codes that Model Explorer would sum and average
        self.assertEqual(by_layer["to_qkv_mlp_proj/q"], "colwise")
        self.assertEqual(by_layer["to_out/mlp_part"], "rowwise")
        self.assertEqual(len(by_layer), 7)
        size_by_layer = {rank[i]["namespace"]: r["value"] for i, r in sizes.items()}
        self.assertEqual(size_by_layer["to_qkv_mlp_proj/q"], 512 * 4096 * 2)
        self.assertEqual(size_by_layer["norm_q"], 128 * 2)
        fused = self.overlay("placement")["fused single_transformer_blocks.0.attn"]["results"]
        self.assertEqual(sorted(r["value"] for r in fused.values()), ["fused", "fused"])
        self.assertTrue(self.overlay("placement")["fused single_transformer_blocks.0.attn"][
            "hideInAggregatedStatsTable"])
        self.assertTrue(self.overlay("bytes per rank")["rank 0 of 8 (tensor parallel)"]["hideInChildrenStatsTable"])

    def test_looked_through_ops_fold_into_one_layer(self):
        from surgery.sight.explore import LOOKED_THROUGH

        with open(self.files["graphs"]) as f:
            rank = json.load(f)["graphCollections"][0]["graphs"][2]["nodes"]
        hidden = [n for n in rank if n["namespace"].split("/")[-1] == LOOKED_THROUGH]
        self.assertGreater(len(hidden), 20)  # rotary arithmetic, casts, views
        # every other op sits in the layer of a node the diagram draws: a projection, norm, attention, ...
        drawn = {fx for n in self.graphs[2].nodes for fx in n.fx}
        drawn |= {n.name for n in self.graphs[2].traced.graph.nodes if n.op == "placeholder"}
        loose = [n["id"] for n in rank if n not in hidden and n["id"] not in drawn and n["label"] != "output"]
        self.assertEqual(loose, [])


def run(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


class Commands(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.config = os.path.join(cls.tmp.name, "config.json")  # klein-4B width, one block of each kind
        with open(cls.config, "w") as f:
            json.dump(dict(VARIANTS["klein-4b"], num_layers=1, num_single_layers=1,
                           _class_name="Flux2Transformer2DModel"), f)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @unittest.skipUnless(diagram.dot_available(), "Graphviz's dot is not installed")
    def test_inspect_svg(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "klein4b.svg")
            code, out, err = run("inspect", "--config", self.config, "--svg", path, "--tp", "2")
            self.assertEqual(code, 0, err)
            ET.parse(path)
        self.assertIn("rank 0 of 2 (tensor parallel): 20 nodes", out)
        with tempfile.TemporaryDirectory() as tmp:  # the README's picture: rank 0's panel only, for an 880 px page
            path = os.path.join(tmp, "rank.svg")
            code, out, err = run("inspect", "--config", self.config, "--svg", path, "--tp", "2", "--panels", "rank",
                                 "--width", "880")
            self.assertEqual(code, 0, err)
            with open(path) as f:
                text = f.read()
        self.assertEqual(out.count("nodes"), 1)
        self.assertIsNone(PW.too_wide("svg", text, 880))
        self.assertNotIn("unfused", text)

    def test_bad_arguments(self):
        code, _, err = run("inspect", "--tp", "2")
        self.assertEqual(code, 2)
        self.assertIn("add --svg OUT.svg", err.strip().splitlines()[-1])
        code, _, err = run("inspect", "--config", self.config, "--svg", "/tmp/never.svg", "--module", "nope")
        self.assertEqual((code, len(err.strip().splitlines())), (1, 1))
        self.assertIn("has no submodule 'nope'", err)
        self.assertFalse(os.path.exists("/tmp/never.svg"))

    @unittest.skipIf(model_explorer is None, "ai-edge-model-explorer is not installed")
    def test_explore_from_inspect_in_a_notebook(self):
        from surgery_rewrites.flux2 import FAMILY

        config = FAMILY.tests.configs["tp_wide"]
        model = surgery.core.build.model_on_meta(FAMILY, config)
        inputs = FAMILY.example_inputs(config, image_tokens=16, text_tokens=8, device="meta")
        with tempfile.TemporaryDirectory() as tmp:
            files = surgery.sight.explore.explore(model, inputs, tp=2, out_dir=tmp, serve=False)
            self.assertTrue(os.path.exists(files["graphs"]))
            self.assertEqual(len(files["node_data"]), 3)  # placement, bytes per rank, all-reduce bytes
            self.assertTrue(all(os.path.exists(path) for path in files["node_data"].values()))

    @unittest.skipIf(model_explorer is None, "ai-edge-model-explorer is not installed")
    def test_explore_says_what_it_wrote_before_serving(self):
        seen = {}

        def serve(files, host, port):  # stands in for the server, which blocks until Ctrl-C
            seen["printed"] = out.getvalue()

        out = io.StringIO()
        with tempfile.TemporaryDirectory() as tmp, mock.patch("surgery.sight.explore.serve_files", serve), \
                contextlib.redirect_stdout(out):
            code = main(["explore", "--config", self.config, "--out", tmp, "--port", "8123"])
        self.assertEqual(code, 0)
        self.assertIn("3 overlays", seen["printed"])
        self.assertIn("http://127.0.0.1:8123", seen["printed"])

    @unittest.skipIf(model_explorer is None, "ai-edge-model-explorer is not installed")
    def test_explore_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            code, out, err = run("explore", "--config", self.config, "--out", tmp, "--no-serve")
            self.assertEqual(code, 0, err)
            self.assertEqual(sorted(os.listdir(tmp)), sorted([
                "block.json", "block.placement.nodedata.json", "block.bytes_per_rank.nodedata.json",
                "block.all-reduce_bytes.nodedata.json"]))


class PageWidth(unittest.TestCase):
    """Every picture fits the page it is read on: each notebook's committed outputs (tests/app/test_notebooks.py checks
    the freshly executed ones the same way) within ~1,000 px, the README's docs/*.svg within ~880 px, and what
    `diagram.svg` draws now at either width, legibly (not scaled below MIN_SCALE)."""

    def test_the_check_catches_a_wide_diagram(self):
        # the README's picture before it was stacked: 2,031 x 725 pt, side by side
        old = '<svg width="2031pt" height="725pt" viewBox="0.00 0.00 2031.00 725.00"></svg>'
        self.assertIn("2708 px wide", PW.too_wide("svg", old, PW.README_WIDTH_PX))
        squeezed = svg.stack_svgs([old], max_width_px=PW.README_WIDTH_PX)
        self.assertIn("too small to read", PW.too_wide("svg", squeezed, PW.README_WIDTH_PX))

    def test_notebook_outputs_fit(self):
        import nbformat

        checked = 0
        for path in PW.NOTEBOOKS:
            notebook = nbformat.read(path, as_version=4)
            for where, kind, data in PW.pictures(notebook):
                checked += 1
                with self.subTest(notebook=path.name, where=where):
                    self.assertIsNone(PW.too_wide(kind, data, PW.NOTEBOOK_WIDTH_PX))
        self.assertGreaterEqual(checked, 14)

    def test_docs_svgs_fit_a_readme(self):
        self.assertTrue(PW.DOCS_SVGS)
        for path in PW.DOCS_SVGS:
            with self.subTest(path.name):
                self.assertIsNone(PW.too_wide("svg", path.read_text(), PW.README_WIDTH_PX))

    @unittest.skipUnless(diagram.dot_available(), "Graphviz's dot is not installed")
    def test_fresh_diagrams_fit_at_natural_size(self):
        # the README's picture (a single block's rank panel) fits a repository page, every form of a double block
        # (six q/k/v projections) a notebook cell, unscaled
        for module, limit in ((None, PW.README_WIDTH_PX), ("transformer_blocks.0", PW.NOTEBOOK_WIDTH_PX)):
            graphs = klein9b_forms(module)[3]
            text = diagram.svg(graphs, "klein-9B", max_width_px=None)
            with self.subTest(module=module):
                self.assertIsNone(PW.too_wide("svg", text, limit))


class OtherFamilies(unittest.TestCase):
    """Labels that come from the graph, not from FLUX.2's names: inputs named by the forward's signature (a block
    called positionally), and the residual edge into the output labelled with the whole value, not with the first
    of the tuple elements split from it."""

    def test_input_names_and_output_edge(self):
        for name in ("flux1", "hunyuan-video"):
            family = surgery.extend.families()[name]
            config = next(iter(family.tests.configs.values()))
            model = surgery.core.build.model_on_meta(family, config)
            inputs = family.example_inputs(config, image_tokens=16, text_tokens=8, device="meta")
            for graph in forms.forms(model, inputs, tp=2):
                with self.subTest(family=name, graph=graph.title):
                    labels = [n.label for n in graph.nodes if n.kind == "input"]
                    self.assertIn("hidden_states", labels)
                    self.assertIn("encoder_hidden_states", labels)
                    self.assertFalse([label for label in labels if label.startswith("arg")])
                    # the block returns (text, image) split from one 1 x (8 + 16) x width residual sum
                    (edge,) = [e for e in graph.edges if e.dst == "output"]
                    self.assertEqual(edge.shape.split("×")[:2], ["1", "24"])
