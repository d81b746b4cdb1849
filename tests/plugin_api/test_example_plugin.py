"""The out-of-tree example plugins (examples/plugins/*), installed as a user would.

CI installs them (scripts/test.sh); elsewhere these tests skip until they are installed with
``pip install -e examples/plugins/brigade-sjf`` (and ``.../brigade-example-stations``).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from brigade import LLM, SamplingParams
from brigade.models.create import create_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugins" / "brigade-sjf"
STATIONS = ROOT / "examples" / "plugins" / "brigade-example-stations"


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


SJF_VERSION = installed_version("brigade-sjf")
STATIONS_VERSION = installed_version("brigade-example-stations")

needs_install = pytest.mark.skipif(
    SJF_VERSION is None,
    reason="the example plugin is not installed: pip install -e examples/plugins/brigade-sjf",
)
needs_stations = pytest.mark.skipif(
    STATIONS_VERSION is None,
    reason="the example stations are not installed: "
    "pip install -e examples/plugins/brigade-example-stations",
)


def test_the_plugin_guide_shows_the_example_files_as_they_are() -> None:
    guide = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    listings = re.findall(r"<!-- example: (\S+) -->\n```\w*\n(.*?)\n```\n", guide, re.DOTALL)
    shown = {path for path, _ in listings}
    assert shown >= {"pyproject.toml", "brigade_sjf/scheduler.py", "brigade_sjf/plugin.py"}
    for path, text in listings:
        expected = (EXAMPLE / path).read_text(encoding="utf-8").rstrip("\n")
        assert text == expected, f"docs/plugins.md's listing of {path} is stale"


@needs_install
def test_brigade_plugins_lists_it_with_its_distribution() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "brigade", "plugins", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {(row["kind"], row["name"]): row for row in json.loads(listing.stdout)}
    sjf = rows[("scheduler", "sjf")]
    assert sjf["distribution"] == f"brigade-sjf {SJF_VERSION}"
    assert sjf["options"] == {"aging_tokens_per_second": 50.0}


@needs_install
def test_selected_by_name_it_generates_for_a_batch(tmp_path: Path) -> None:
    model_dir = create_model(tmp_path / "llama", "llama", overrides={"num_hidden_layers": 2})
    llm = LLM(
        overrides=[
            f"model.path={model_dir}",
            'scheduler.plugin="sjf"',
            "scheduler.max_num_seqs=2",
            "kv.page_size=4",
            "kv.num_pages=24",  # small enough that the batch preempts
        ]
    )
    assert type(llm.engine.scheduler.policy).__name__ == "SjfPolicy"
    lengths = [12, 3, 7, 1, 9, 5]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    prompts = [[(7 * i + j) % 200 + 3 for j in range(10 + i)] for i in range(len(lengths))]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_pages() == 24


@needs_stations
def test_brigade_plugins_lists_the_example_stations() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "brigade", "plugins", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {(row["kind"], row["name"]): row for row in json.loads(listing.stdout)}
    for key in [
        ("sampler", "plain-torch"),
        ("logits_processor", "repeat-last-n"),
        ("attention", "gather-sdpa"),
    ]:
        assert rows[key]["distribution"] == f"brigade-example-stations {STATIONS_VERSION}"
    assert rows[("logits_processor", "repeat-last-n")]["options"] == {
        "last_n": 64,
        "penalty": 1.1,
    }


@needs_stations
def test_the_example_stations_generate_together_as_the_built_ins_do(tmp_path: Path) -> None:
    model_dir = create_model(tmp_path / "llama", "llama", overrides={"num_hidden_layers": 2})
    base = [f"model.path={model_dir}", "kv.page_size=4", "kv.num_pages=64"]
    swapped = LLM(
        overrides=[
            *base,
            'sampler.plugin="plain-torch"',
            'attention.plugin="gather-sdpa"',
            'sampler.logits_processors=["repeat-last-n"]',
            "sampler.logits_processor_options={repeat-last-n = {penalty = 1.0}}",
        ]
    )
    assert type(swapped.engine.sampler).__name__ == "PlainTorchSampler"
    prompts = [[(7 * i + j) % 200 + 3 for j in range(10 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # Penalty 1 leaves every request alone unless it asks: greedy tokens as the built-ins'.
    expected = [o.outputs[0].token_ids for o in LLM(overrides=base).generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in swapped.generate(prompts, params)] == expected
    # One request asks for the penalty through its extra: it alone never repeats a token.
    extra = [{"repeat_last_n": 64, "repeat_penalty": 1e6}, {}, {}, {}]
    outputs = swapped.generate(prompts, params, extra=extra)
    penalised = outputs[0].outputs[0].token_ids
    assert not set(penalised) & set(prompts[0])
    assert len(set(penalised)) == len(penalised)
    assert [o.outputs[0].token_ids for o in outputs[1:]] == expected[1:]


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(EXAMPLE, marks=needs_install, id="brigade-sjf"),
        pytest.param(STATIONS, marks=needs_stations, id="brigade-example-stations"),
    ],
)
def test_its_own_test_suite_passes(example: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=example,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout
