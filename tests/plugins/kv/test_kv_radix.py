"""The ``radix`` KV manager: conformance, token-granular reuse, node splits, LRU leaf eviction,
tree invariants under random workloads, and greedy tokens through the engine vs ``paged``."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_same_greedy, prompts, run
from hypothesis import given, settings
from hypothesis import strategies as st

from brigade import LLM
from brigade.interfaces import KVPoolParams, Request, RequestStatus
from brigade.models.create import create_model
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.plugins.kv.radix import RadixKVManager, RadixKVOptions, _Node
from brigade.testing.conformance.kv import check_kv_manager
from brigade.testing.requests import cached_once, make_request, probe_hit, run_prefill


def new_kv(num_pages: int, caching: bool = True) -> RadixKVManager:
    return RadixKVManager(KVPoolParams(num_pages, 1, caching), RadixKVOptions())


def tokens(tag: int, num_tokens: int) -> list[int]:
    return [tag * 1000 + i for i in range(num_tokens)]


def edges(node: _Node) -> list[list[int]]:
    """The token runs of ``node``'s children, in key order."""
    return [node.children[key].token_ids for key in sorted(node.children)]


def test_radix_manager_conforms() -> None:
    check_kv_manager(RadixKVManager, RadixKVOptions(), page_sizes=(1,))


@pytest.mark.parametrize("page_size", [2, 16])
def test_page_sizes_other_than_one_are_refused(page_size: int) -> None:
    with pytest.raises(ValueError, match="page_size = 1"):
        RadixKVManager(KVPoolParams(64, page_size), RadixKVOptions())


def test_a_match_ending_inside_an_edge_splits_it_and_shares_its_pages() -> None:
    kv = new_kv(64)
    owner = tokens(1, 10)
    table = cached_once(kv, owner)
    assert edges(kv._root) == [owner]
    branch = make_request("branch", [*owner[:6], 7, 8])
    assert run_prefill(kv, branch) == 6  # every shared token, not a page multiple
    assert list(kv.block_table(branch))[:6] == table[:6]
    [head] = kv._root.children.values()
    assert head.token_ids == owner[:6]
    assert head.lock_count == 1
    assert edges(head) == [[7, 8], owner[6:]]  # the split tail and the branch's own tokens
    assert probe_hit(kv, [*owner, 5]) == 10
    assert probe_hit(kv, [*owner[:6], 7, 8, 9]) == 8


def test_branching_conversations_reuse_every_shared_token_where_pages_cannot() -> None:
    system = tokens(1, 21)  # ends 5 tokens into the second 16-token page
    questions = [tokens(2, 7), tokens(3, 12)]
    radix = new_kv(256)
    paged = PagedKVManager(KVPoolParams(64, 16), PagedKVOptions())
    for kv in (radix, paged):
        run_prefill(kv, make_request("first", system + questions[0]))
    second = make_request("second", system + questions[1])
    assert run_prefill(radix, second) == len(system)
    assert run_prefill(paged, make_request("second", system + questions[1])) == 16
    # The conversation goes on: the second turn extends the first answer mid-"page".
    second.output_token_ids += [5, 6, 7]
    assert radix.allocate(second, 2) is not None
    second.num_computed_tokens += 2
    radix.commit(second)
    turn = make_request("turn", [*second.all_token_ids, 9])
    assert run_prefill(radix, turn) == len(system) + len(questions[1]) + 2


def test_lru_evicts_least_recently_used_leaves_whole_or_their_tails_then_parents() -> None:
    kv, shared = new_kv(14), tokens(1, 4)
    cached_once(kv, [*shared, *tokens(2, 4)], "older")
    cached_once(kv, [*shared, *tokens(3, 4)], "newer")  # splits the trunk off: 12 pages cached
    assert kv.num_free_pages() == 14
    taker = make_request("taker", tokens(4, 6))
    assert kv.allocate(taker, 6) is not None  # 2 free pages and the older leaf
    kv.free(taker)
    assert probe_hit(kv, [*shared, *tokens(3, 4), 0]) == 8
    assert probe_hit(kv, [*shared, *tokens(2, 4), 0]) == 4
    taker = make_request("taker", tokens(4, 12))
    assert kv.allocate(taker, 12) is not None  # 6 free, the newer leaf, then the trunk's tail
    kv.free(taker)
    assert probe_hit(kv, [*shared, 0]) == 2
    kv = new_kv(8)
    cached_once(kv, tokens(1, 8))
    taker = make_request("taker", tokens(4, 3))
    assert kv.allocate(taker, 3) is not None
    kv.free(taker)
    assert probe_hit(kv, tokens(1, 7)) == 5  # the leaf lost its last 3 tokens only


def test_the_eviction_heap_stays_bounded_by_the_pool() -> None:
    kv = new_kv(8)
    cached_once(kv, tokens(1, 4))
    cached_once(kv, tokens(2, 4))
    for _ in range(3000):  # each lock and unlock leaves a stale entry behind
        assert probe_hit(kv, [*tokens(2, 3), 0]) == 3
    assert len(kv._heap) <= 2 * 8 + 1024 + 1
    taker = make_request("taker", tokens(3, 4))
    assert kv.allocate(taker, 4) is not None  # the least recently used prefix goes
    kv.free(taker)
    assert probe_hit(kv, [*tokens(2, 4), 0]) == 4
    assert probe_hit(kv, [*tokens(1, 4), 0]) == 0


def decode(kv: RadixKVManager, request: Request, token: int) -> None:
    """Append ``token``, reserve and compute it, and commit, as core does after a step."""
    request.output_token_ids.append(token)
    assert kv.allocate(request, 1) is not None
    request.num_computed_tokens += 1
    kv.commit(request)


def test_requests_computing_cached_tokens_borrow_them_and_keep_publishing() -> None:
    kv = new_kv(32)
    prompt = tokens(1, 6)
    first, second, third, late = (make_request(name, prompt) for name in "abcd")
    for request in (first, second, third, late):  # all admitted before any commits: no hits
        assert kv.allocate(request, request.num_tokens) is not None
        request.num_computed_tokens = request.num_tokens
    kv.commit(first)
    kv.commit(second)  # the first request's pages hold these tokens: the second borrows them
    [node] = kv._root.children.values()
    assert node.page_ids == list(kv.block_table(first))
    assert node.lock_count == 2
    decode(kv, second, 3)  # and its own tokens still go into the tree, below the borrowed node
    kv.free(first)  # no one reads the first request's pages now: the second's copy replaces them
    assert node.page_ids == list(kv.block_table(second))[:6]
    assert not node.borrowers
    assert kv.num_free_pages() == 32 - 7 - 6 - 6
    kv.commit(third)
    decode(kv, third, 4)
    kv.free(second)
    assert node.page_ids == list(kv.block_table(third))[:6]
    assert edges(node) == [[3], [4]]
    kv.free(third)
    assert probe_hit(kv, [*prompt, 3, 0]) == probe_hit(kv, [*prompt, 4, 0]) == 7
    kv.commit(late)  # the node is unlocked: the late request's copy replaces it outright
    assert node.page_ids == list(kv.block_table(late))
    assert node.lock_count == 1
    assert kv.num_free_pages() == 32 - 6


def test_a_borrowed_node_splits_with_its_borrowers() -> None:
    kv, prompt = new_kv(32), tokens(1, 6)
    content: dict[int, tuple[int, ...]] = {}
    first, second = make_request("a", prompt), make_request("b", prompt)
    for request in (first, second):
        assert kv.allocate(request, 6) is not None
    for request in (first, second):
        compute(kv, request, content, [])
    third = make_request("c", [*prompt[:3], 9, 9])
    allocation = kv.allocate(third, 5)
    assert allocation is not None
    assert allocation.num_cached_tokens == 3
    third.num_computed_tokens = 3
    compute(kv, third, content, [])
    [head] = kv._root.children.values()
    assert head.token_ids == prompt[:3]
    assert head.lock_count == 3
    assert len(head.borrowers) == 1
    check_tree(kv, [first, second, third], content)
    kv.free(first)  # the third request still reads the head; the tail passes to the second
    check_tree(kv, [second, third], content)
    kv.free(second)
    check_tree(kv, [third], content)
    assert kv.num_free_pages() == 32 - 5


def check_tree(kv: RadixKVManager, live: list[Request], content: dict[int, tuple[int, ...]]) -> set:
    """Check the tree against the live requests and the modelled page contents; returns every
    token string the tree spells from the root to a node's end."""
    expected_locks: dict[int, int] = {}
    held: set[int] = set()
    private: list[int] = []
    for request in live:
        state, table = kv._running[request.request_id], list(kv.block_table(request))
        held.update(table)
        private += table[state.num_committed :]
        node = state.node
        while node is not kv._root:  # a locked path is never evicted: it reaches the root
            assert node.parent is not None
            assert node.parent.children[node.token_ids[0]] is node
            expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
            own = table[node.start : node.start + len(node.page_ids)]
            if state in node.borrowers:
                private += own
            else:
                assert own == node.page_ids, "a path user that does not borrow reads the pages"
            node = node.parent
    spelled: set[tuple[int, ...]] = set()
    tree_pages: list[int] = []
    num_unlocked = 0
    stack: list[tuple[_Node, tuple[int, ...]]] = [(kv._root, ())]
    while stack:
        node, prefix = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node
            assert child.token_ids
            assert child.token_ids[0] == key
            assert len(child.token_ids) == len(child.page_ids), "one page per token"
            assert child.lock_count == expected_locks.get(id(child), 0), "lock = users of the path"
            assert not child.lock_count or len(child.borrowers) < child.lock_count, "no reader"
            num_unlocked += 0 if child.lock_count else len(child.page_ids)
            spelling = prefix + tuple(child.token_ids)
            for index, page in enumerate(child.page_ids, start=len(prefix)):
                assert content[page] == spelling[: index + 1], f"page {page} holds other KV"
            tree_pages += child.page_ids
            spelled.add(spelling)
            stack.append((child, spelling))
    pages = [*kv._free, *tree_pages, *private]
    assert sorted(pages) == list(range(kv.pool.num_pages)), "free + tree + private != pool"
    assert kv._num_evictable == num_unlocked
    assert kv.num_free_pages() == kv.pool.num_pages - len(held)
    return spelled


def longest_prefix(token_ids: list[int], spelled: set[tuple[int, ...]]) -> int:
    best = 0
    for spelling in spelled:
        length = 0
        for mine, theirs in zip(token_ids, spelling, strict=False):
            if mine != theirs:
                break
            length += 1
        best = max(best, length)
    return best


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "twin", "step", "step", "step", "finish", "preempt"]),
        st.lists(st.integers(1, 2), min_size=1, max_size=6),
        st.integers(0, 99),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(4, 40), ops=OPS)
def test_tree_invariants_hold_under_random_inserts_matches_and_evictions(
    num_pages: int, ops: list[tuple[str, list[int], int]]
) -> None:
    run_workload(new_kv(num_pages), ops)


def run_workload(kv: RadixKVManager, ops: list[tuple[str, list[int], int]]) -> None:
    """Admit, compute in small chunks, decode, finish and preempt requests as ``ops`` say,
    checking every hit against a brute-force longest prefix and the tree after each op.

    ``twin`` admits a copy of a running request's tokens, so two requests compute the same
    tokens at once (one borrows the other's node); prompts draw on a two-token alphabet and
    on earlier sequences, so matches end inside edges and split them.
    """
    live: list[Request] = []
    waiting: list[Request] = []
    history: list[list[int]] = [[]]
    content: dict[int, tuple[int, ...]] = {}
    spelled: set[tuple[int, ...]] = set()
    for index, (op, suffix, value) in enumerate(ops):
        if op in ("finish", "preempt") and live:
            request = live.pop(value % len(live))
            request.status = RequestStatus.FINISHED_STOPPED
            kv.free(request)
            if op == "preempt":
                request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
                waiting.append(request)
        elif op in ("admit", "twin") or not live:
            if waiting and value % 2:
                request = waiting.pop()
            elif op == "twin" and live:
                request = make_request(f"r{index}", live[value % len(live)].all_token_ids)
            else:
                base = history[value % len(history)]
                request = make_request(f"r{index}", base[: value % (len(base) + 1)] + suffix)
            token_ids = request.all_token_ids
            expected_hit = min(request.num_tokens - 1, longest_prefix(token_ids, spelled))
            allocation = kv.allocate(request, 1 + value % 4)  # small chunks interleave twins
            if allocation is None:
                waiting.append(request)
                continue
            assert allocation.num_cached_tokens == expected_hit == request.num_cached_tokens
            table = list(kv.block_table(request))
            for position in range(expected_hit):
                assert content[table[position]] == tuple(token_ids[: position + 1])
            request.num_computed_tokens = expected_hit
            live.append(request)
            compute(kv, request, content, history)
        else:
            request = live[value % len(live)]
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(suffix[0])
            before = list(kv.block_table(request))
            if kv.allocate(request, 1 + value % 4) is None:
                assert list(kv.block_table(request)) == before
                continue
            compute(kv, request, content, history)
        spelled = check_tree(kv, live, content)
        # Nothing is made up: the tree spells only prefixes of computed sequences.
        assert all(any(h[: len(s)] == list(s) for h in history) for s in spelled)


def compute(
    kv: RadixKVManager,
    request: Request,
    content: dict[int, tuple[int, ...]],
    history: list[list[int]],
) -> None:
    """Write the KV of every reserved token into the model of the pool, then commit like core."""
    table, token_ids = list(kv.block_table(request)), request.all_token_ids
    for position in range(request.num_computed_tokens, len(table)):
        content[table[position]] = tuple(token_ids[: position + 1])
    request.num_computed_tokens = len(table)
    kv.commit(request)
    history.append(token_ids[: len(table)])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    return create_model(root / "llama", "llama", overrides={"num_hidden_layers": 2})


def test_greedy_tokens_match_paged_and_no_cache_through_the_engine(model_dir: Path) -> None:
    base = [f"model.path={model_dir}", "model.dtype=float32"]
    configs = {
        "no cache": ["kv.page_size=16", "kv.num_pages=64", "kv.enable_prefix_caching=false"],
        "paged": ["kv.page_size=16", "kv.num_pages=64"],
        "radix": ['kv.plugin="radix"', "kv.page_size=1", "kv.num_pages=1024"],
        "radix, 8-token chunks": [
            'kv.plugin="radix"',
            "kv.page_size=1",
            "kv.num_pages=1024",
            "scheduler.max_num_batched_tokens=8",
        ],
        # About one sequence at a time: cached prefixes are evicted, requests preempted.
        "radix, 64-token pool": ['kv.plugin="radix"', "kv.page_size=1", "kv.num_pages=64"],
    }
    llms = {name: LLM(overrides=[*base, *settings]) for name, settings in configs.items()}
    system = prompts([21], seed=5)[0]  # ends mid-page for 16-token pages
    first_turn = [system + q for q in prompts([4, 9, 2], seed=6)]
    reference = run(llms["no cache"], first_turn)
    # Second turn: conversations go on after their answers, and new branches share the system.
    second_turn = [
        first_turn[0] + reference[0][0] + prompts([3], seed=7)[0],
        first_turn[1][:25] + prompts([5], seed=8)[0],
        system[:18] + prompts([6], seed=9)[0],
    ]
    reference += run(llms["no cache"], second_turn)
    hits = {}
    for name, llm in llms.items():
        if name != "no cache":
            ours = run(llm, first_turn) + run(llm, second_turn)
            assert_same_greedy(ours, reference, name)
            hits[name] = llm.engine.kv.stats().prefix_cache_hits
    # The engine computes the first-turn prompts in one step, so only the second turn hits
    # (an answer's last token is sampled but never computed): radix finds every shared token,
    # paged only the whole 16-token pages of them.
    answer = len(first_turn[0]) + len(reference[0][0]) - 1
    assert hits["radix"] == answer + 25 + 18, hits
    assert hits["paged"] == answer // 16 * 16 + 16 + 16, hits
    assert hits["radix, 8-token chunks"] >= hits["radix"], hits
    assert llms["radix, 64-token pool"].engine.scheduler.stats().num_preemptions > 0
