"""The plugin registry: entry point discovery, duplicates, unknown names, listings."""

from __future__ import annotations

import dataclasses
import json

import pytest
from plugin_fakes import install_fake_plugin

from brigade.cli import main
from brigade.errors import DuplicateComponentError, UnknownComponentError
from brigade.interfaces import NoOptions, SchedulingPolicy, option
from brigade.registry import Registry, load_registry


@dataclasses.dataclass(frozen=True)
class ShortestFirstOptions:
    max_wait_steps: int = option(100, help="age after which a long job runs anyway", ge=1)


def shortest_first(*args: object) -> tuple[object, ...]:
    """A factory that accepts any kind's arguments (these tests never build it)."""
    return args


def test_builtins_are_registered_through_the_entry_point() -> None:
    registry = load_registry()
    assert "sdpa" in registry.names("attention")
    assert "torch" in registry.names("executor")
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(registry.names("model"))
    assert registry.get("attention", "sdpa").distribution.startswith("brigade-llm ")


def test_third_party_entry_point_is_discovered(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_plugin(
        monkeypatch,
        "brigade-fake-sjf",
        lambda r: r.add("scheduler", "fake-sjf", shortest_first, options=ShortestFirstOptions),
    )
    component = load_registry().get("scheduler", "fake-sjf")
    assert component.factory is shortest_first
    assert component.options_type is ShortestFirstOptions
    assert component.distribution == "brigade-fake-sjf 1.2.3"


def test_duplicate_name_fails_naming_both_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_plugin(
        monkeypatch, "brigade-evil-sdpa", lambda r: r.add("attention", "sdpa", shortest_first)
    )
    with pytest.raises(DuplicateComponentError) as excinfo:
        load_registry()
    message = str(excinfo.value)
    assert "attention 'sdpa' is registered twice" in message
    assert "brigade-llm" in message
    assert "brigade-evil-sdpa 1.2.3" in message


def test_unknown_name_lists_registered_names() -> None:
    registry = load_registry()
    with pytest.raises(UnknownComponentError, match=r"no attention plugin named 'flash'.*sdpa"):
        registry.get("attention", "flash")


@pytest.mark.parametrize(
    ("kind", "name", "factory", "options", "error", "match"),
    [
        ("stove", "x", shortest_first, None, ValueError, "unknown component kind 'stove'"),
        ("scheduler", "", shortest_first, None, ValueError, "non-empty"),
        ("scheduler", "x", 42, None, TypeError, "not callable"),
        ("scheduler", "x", shortest_first, dict, TypeError, "must be a dataclass"),
    ],
)
def test_bad_registrations_fail_loudly(
    kind: str, name: str, factory: object, options: type | None, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        Registry().add(kind, name, factory, options=options)


def test_options_without_defaults_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class NeedsValue:
        window: int

    with pytest.raises(TypeError, match="every option needs a default; missing for window"):
        Registry().add("scheduler", "x", shortest_first, options=NeedsValue)


def test_no_options_defaults_to_empty_schema() -> None:
    registry = Registry()
    registry.add("sampler", "plain", shortest_first)
    assert registry.get("sampler", "plain").options_type is NoOptions


def test_plugins_command_lists_kind_name_distribution_and_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    install_fake_plugin(
        monkeypatch,
        "brigade-fake-sjf",
        lambda r: r.add("scheduler", "fake-sjf", shortest_first, options=ShortestFirstOptions),
    )
    from brigade import registry as registry_module

    registry_module.default_registry.cache_clear()
    try:
        assert main(["plugins", "--json"]) == 0
    finally:
        registry_module.default_registry.cache_clear()
    rows = json.loads(capsys.readouterr().out)
    by_name = {(r["kind"], r["name"]): r for r in rows}
    assert by_name[("scheduler", "fake-sjf")] == {
        "kind": "scheduler",
        "name": "fake-sjf",
        "distribution": "brigade-fake-sjf 1.2.3",
        "options": {"max_wait_steps": 100},
    }
    executor = by_name[("executor", "torch")]
    assert executor["distribution"].startswith("brigade-llm")
    assert executor["options"]["device"] == "auto"


class _HalfPolicy(SchedulingPolicy):
    """A SchedulingPolicy that forgot most of its methods."""

    def enqueue(self, request: object, *, preempted: bool) -> None:
        pass


class _OneXScheduler:
    """A 1.x scheduler: it planned whole steps itself (factory(params, kv, options))."""

    def __init__(self, params: object, kv: object, options: object) -> None:
        pass

    def schedule(self) -> None:
        pass


def _one_argument(view: object) -> object:
    return view


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (
            _OneXScheduler,
            r"does not implement the SchedulingPolicy contract: subclass "
            r"brigade.interfaces.SchedulingPolicy and define __len__, enqueue, peek, remove "
            r"\(written for API 1.x\? see docs/plugins.md, \"Migrating a 1.x plugin to 2.0\"\)",
        ),
        (
            _HalfPolicy,
            r"leaves SchedulingPolicy methods unimplemented: __len__, peek, remove",
        ),
        (
            _one_argument,
            r"core calls the factory as factory\(view, options\), but "
            r"'_one_argument' takes \(view\)",
        ),
    ],
)
def test_a_factory_is_checked_against_its_kinds_contract(factory: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        Registry().add("scheduler", "broken", factory)


def test_every_builtin_passes_the_contract_check() -> None:
    registry = load_registry()  # each add() ran the check
    assert len(list(registry)) > 10
