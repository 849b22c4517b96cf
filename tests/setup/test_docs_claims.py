"""The claims a reader can check in README.md and docs/ hold: the diff sizes the README quotes,
the data-parallel line near the top of each trainer, and every relative link."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

DIFF_CLAIM = re.compile(r"^diff -w (\S+) (\S+)\s+# (\d+) changed lines", re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# The call that makes each trainer data-parallel, and how far down a reader finds it.
TRANSFORMS = {  # the name called (nn.DataParallel(, lax.pmean(: an attribute's name)
    "torch_dp.py": "DataParallel", "torch_ddp.py": "DDP", "torch_fsdp.py": "fully_shard",
    "jax_pmap.py": "pmean", "jax_shard.py": "NamedSharding",
    "jax_fsdp.py": "with_sharding_constraint", "mxnet_gluon.py": "split_and_load",
}  # fmt: skip
FIRST_LINES = 160


def changed_lines(a: Path, b: Path) -> int:
    """What `diff -w a b | grep -c '^[<>]'` counts: lines removed plus lines added, whitespace
    ignored."""
    norm = lambda p: [re.sub(r"\s+", "", line) for line in p.read_text().splitlines()]
    ops = difflib.SequenceMatcher(None, norm(a), norm(b), autojunk=False).get_opcodes()
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def test_the_readme_quotes_the_diff_sizes_as_they_are(tmp_path):
    claims = DIFF_CLAIM.findall((ROOT / "README.md").read_text())
    assert len(claims) >= 2
    for a, b, n in claims:
        # difflib and GNU diff may pair lines differently; a stale figure is off by far more.
        got = changed_lines(ROOT / a, ROOT / b)
        assert abs(got - int(n)) <= 4, f"README says {n} changed lines for {a} {b}; it is {got}"
    changed = tmp_path / "b.py"  # 20 lines more: counted
    changed.write_text((ROOT / b).read_text() + "x = 1\n" * 20)
    assert changed_lines(ROOT / a, changed) == changed_lines(ROOT / a, ROOT / b) + 20


@pytest.mark.parametrize("trainer", sorted(TRANSFORMS))
def test_the_data_parallel_call_is_within_the_first_lines_of_its_trainer(trainer):
    lines = first_call((ROOT / "frameworks" / trainer).read_text(), TRANSFORMS[trainer])
    assert lines, f"{trainer} never calls {TRANSFORMS[trainer]}"
    assert lines <= FIRST_LINES, f"{trainer}: {TRANSFORMS[trainer]}( first called at line {lines}"


def first_call(source: str, name: str) -> int | None:
    """The first line that calls `name` (a bare name or an attribute: lax.pmean): code only,
    never a comment or a docstring."""
    found = [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == name
    ]
    return min(found, default=None)


def test_prose_and_comments_do_not_count_as_the_data_parallel_call():
    source = '"""Docstring: NamedSharding(mesh)."""\n# NamedSharding(mesh)\ns = NamedSharding(m)\n'
    assert first_call(source, "NamedSharding") == 3
    assert first_call("y = lax.pmean(g, 'batch')\n", "pmean") == 1
    assert first_call("y = 1  # lax.pmean(g)\n", "pmean") is None


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "docs" / "results").glob("**/README.md"))]  # fmt: skip


def broken_links(md: Path) -> list[str]:
    out = []
    for target in LINK.findall(md.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        if not (md.parent / target).exists():
            out.append(target)
    return out


def test_every_relative_link_in_the_docs_resolves(tmp_path):
    broken = {str(md.relative_to(ROOT)): b for md in markdown_files() if (b := broken_links(md))}
    assert not broken
    md = tmp_path / "x.md"  # the check can fail
    (tmp_path / "there.md").write_text("")
    md.write_text("[a](there.md) [b](gone/away.md) [c](https://example.org/x) [d](there.md#top)")
    assert broken_links(md) == ["gone/away.md"]
