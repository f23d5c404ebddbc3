"""The `surgery` command never answers an argument with a traceback (issue 41: `surgery plan --tp
99999999999999999999999` printed one from torch's process group): hostile arguments to every verb end in one line
and a non-zero exit, 2 for a usage error; an error nobody foresaw is one line too, naming itself as a bug."""

import contextlib
import io
import json
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from parameterized import parameterized

from surgery.app.cli import main

BIG = "99999999999999999999999"
TMP = Path(tempfile.mkdtemp(prefix="surgery-hostile-"))


def config(**values) -> str:
    path = TMP / f"config{len(list(TMP.iterdir()))}.json"
    path.write_text(json.dumps({"_class_name": "Flux2Transformer2DModel", **values}))
    return str(path)


USAGE = [  # refused by the argument parser: exit 2
    ["plan", "--tp", BIG], ["plan", "--tp", str(2**31)], ["plan", "--tp", "2", "--cp", BIG],
    ["plan", "--tp", "2", "--dp", BIG], ["plan", "--tp", "2", "--image-tokens", BIG],
    ["plan", "--tp", "2", "--text-tokens", BIG], ["plan", "--tp", "nan"], ["plan", "--tp", "-1"], ["plan", "--tp", ""],
    ["plan", "--model", "", "--tp", "2"], ["plan", "--show-plan", "--tp", BIG], ["plan", "--pipeline", "--tp", BIG],
    ["plan", "--quant", "q4", "--tp", BIG], ["plan", "--tp", "2", "--dtype", "int8"],
    ["inspect", "--svg", str(TMP / "a.svg"), "--tp", BIG], ["inspect", "--svg", str(TMP / "b.svg"), "--width", BIG],
    ["inspect", "--tp", "2"],
    ["explore", "--port", BIG], ["explore", "--port", "x"], ["explore", "--no-serve", "--tp", BIG],
    ["convert", str(TMP)], ["convert", str(TMP), str(TMP / "o"), "--to", "sideways"],
    ["families", "--world", BIG], ["families", "--world", "0"],
    ["demo", "--tp", BIG], ["demo", "--layers", BIG], ["demo", "--single-layers", "-3"], ["demo", "--head-dim", BIG],
    ["demo", "--seed", BIG], ["demo", "--seed", "-1"], ["demo", "--image-tokens", BIG], ["demo", "--text-tokens", "1e9"],
    ["demo", "--model", "flux1-dev", "--tp", str(2**40)], ["demo", "--model", "nope"],
    ["--bogus"], [],
]
REFUSED = [  # refused by the command's own checks: exit 1, one line
    ["plan", "--tp", "2", "--config", "/nonexistent.json"], ["plan", "--tp", "2", "--config", str(TMP)],
    ["plan", "--tp", "2", "--config", "/dev/null"],
    ["plan", "--tp", "2", "--config", config(num_attention_heads=-3)],
    ["plan", "--tp", "2", "--config", config(num_attention_heads="x")],
    ["plan", "--tp", "2", "--config", config(joint_attention_dim=10**30)],
    ["plan", "--tp", "2", "--config", config(attention_head_dim=[1, 2])],
    ["plan", "--tp", "2", "--config", config(bogus_key=1)],
    ["plan", "--tp", "2", "--config", config(_class_name=["x"])],
    ["inspect", "--config", config(num_attention_heads=0)],
    ["convert", "/nonexistent", str(TMP / "o")], ["convert", str(TMP), str(TMP)],
    ["convert", str(TMP), str(TMP / "o"), "--max-shard-size", "abc"],
    ["convert", str(TMP), str(TMP / "o"), "--variant", "../../x"],
]


def run(args: list[str]) -> tuple[object, list[str]]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(args)
        except SystemExit as exit_:
            code = exit_.code
    return code, stderr.getvalue().strip().splitlines()


class HostileArguments(unittest.TestCase):
    @parameterized.expand([(" ".join(a).replace(str(TMP), "TMP")[:60], a) for a in USAGE])
    def test_usage_errors_exit_two_with_the_reason_last(self, _, args):
        code, lines = run(args)
        self.assertEqual(code, 2, lines)
        self.assertNotIn("Traceback", "\n".join(lines))
        self.assertRegex(lines[-1], r"^surgery( \w+)?: error: ")

    @parameterized.expand([(" ".join(a).replace(str(TMP), "TMP")[:60], a) for a in REFUSED])
    def test_refusals_exit_one_with_one_line(self, _, args):
        code, lines = run(args)
        self.assertEqual(code, 1, lines)
        self.assertEqual(len(lines), 1, lines)
        self.assertRegex(lines[0], rf"^surgery {args[0]}: ")
        self.assertNotIn("unexpected", lines[0])  # the command's own refusal, not the last resort below

    def test_a_config_too_large_to_build_is_refused_before_the_model_class_sees_it(self):
        code, lines = run(["plan", "--tp", "2", "--config", config(num_layers=10**30)])  # a loop that would not end
        self.assertEqual((code, lines), (1, ["surgery plan: flux2: config num_layers=" + "1" + "0" * 30 + "; the most "
                                             "a model is built with here is 1024."]))

    def test_an_unforeseen_error_is_one_line_naming_itself_a_bug(self):
        with mock.patch("surgery.app.cli._plan_or_inspect", side_effect=TypeError("incompatible\nconstructor")):
            code, lines = run(["plan", "--tp", "2"])
        self.assertEqual(code, 1)
        self.assertEqual(lines, ["surgery plan: unexpected TypeError: incompatible constructor (a bug in surgery: "
                                 "please report it with this command line)"])


if __name__ == "__main__":
    unittest.main()
