"""Suffix decoding: draft the most frequent continuation of the request's latest tokens, as
seen in its own text and in the outputs of recently finished requests.

After SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975; Snowflake's Arctic Inference).
Agentic loops, tool calls, self-refinement and structured answers repeat text across
requests, not only within one: counting what followed each context over a bounded window of
finished requests drafts those repeats where prompt lookup (``ngram``) finds nothing, and the
counts say how far a draft is worth checking.

Structure (one :class:`_ContextCounts` per request, one for the corpus of finished requests):
every context of 1 .. ``max_depth`` tokens that occurred in the indexed text maps to the
tokens that followed it, with counts. A request's index is extended by the tokens it gained
since the previous call; a finished request's output is added by :meth:`SuffixProposer.remove`
and, once ``max_cached_requests`` newer ones joined, subtracted exactly as it was added. A
draft is a path, not a tree: from the longest context that ends the request's tokens and
occurs in either index (the request's own wins ties), append the context's most frequent
follower and repeat, while the product of ``count(follower) / count(context)`` along the path
stays at or above ``min_probability``.

Memory: each indexed token adds at most ``max_depth`` contexts, so a request's index holds at
most ``max_request_tokens x max_depth`` of them whatever its length (its window slides, and
what leaves it is subtracted); the corpus at most ``max_cached_requests`` times that. On
CPython that is about 1.3 KB per indexed token of novel text at depth 16, so about 5 MB for a
full window and, in the worst case (128 cached outputs of 4096+ tokens each), 650 MB for the
corpus; text that repeats shares contexts and costs less.

Defaults: ``max_depth`` 16, since deeper matches rarely change the most frequent follower and
each level costs a context per token (Arctic Inference uses 24, but its depth also caps the
draft); ``min_probability`` 0.1 and ``max_spec_factor`` 1 as in Arctic Inference and vLLM;
``max_cached_requests`` 128 and ``max_request_tokens`` 4096 to keep the memory above bounded
(outputs of a few hundred tokens make the corpus tens of MB).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from brigade.interfaces import DraftSlot, Proposer, ProposerParams, Request, option

__all__ = ["SuffixOptions", "SuffixProposer"]


@dataclasses.dataclass(frozen=True)
class SuffixOptions:
    max_depth: int = option(
        16,
        help="longest context (tokens) matched against the indexed text; each level costs "
        "one entry per indexed token",
        ge=1,
        le=64,
    )
    min_probability: float = option(
        0.1,
        help="stop drafting once the estimated probability that the whole draft is accepted "
        "(product of each token's share of its context's followers) falls below this",
        ge=0.0,
        le=1.0,
    )
    max_spec_factor: float = option(
        1.0,
        help="draft at most this many tokens per token of the matched context: a 1-token "
        "match seen once is a coincidence, not a pattern (Arctic Inference's default)",
        gt=0.0,
        le=64.0,
    )
    max_cached_requests: int = option(
        128,
        help="finished requests whose outputs stay in the shared corpus (oldest evicted; "
        "0 disables the corpus)",
        ge=0,
        le=100_000,
    )
    max_request_tokens: int = option(
        4096,
        help="a request's most recent tokens that are indexed, in its own index and in its "
        "share of the corpus: bounds memory per request",
        ge=2,
        le=1_000_000,
    )
    index_prompts: bool = option(
        False,
        help="add finished requests' prompts to the corpus too, not only their outputs "
        "(helps when prompts repeat across requests; costs memory)",
    )


class _Followers(dict[int, int]):
    """Token -> how often it followed one context, for a context seen at least twice, with
    the total and the most frequent token (highest count, then lowest id: the same whatever
    the order counts arrived in, so an evicted request leaves no trace)."""

    __slots__ = ("best", "total")

    def __init__(self, first: int, second: int) -> None:
        super().__init__()
        self.total = 0
        self.best: int | None = first
        self.add(first)
        self.add(second)

    def add(self, token: int) -> None:
        count = self.get(token, 0) + 1
        self[token] = count
        self.total += 1
        best = self.best
        if best is not None and (count > self[best] or (count == self[best] and token < best)):
            self.best = token

    def discard(self, token: int) -> None:
        count = self[token] - 1
        if count:
            self[token] = count
        else:
            del self[token]
        self.total -= 1
        if token == self.best:
            self.best = None  # found again by the next lookup, if any (evictions are rare)

    def most_frequent(self) -> int:
        if self.best is None:
            self.best = min(self, key=lambda token: (-self[token], token))
        return self.best


class _ContextCounts:
    """Context -> the tokens that followed it, with counts.

    A context is keyed by ``hash(tuple(tokens))``: a 64-bit int instead of a tuple of up to
    ``max_depth`` ints halves the memory; two contexts that collide only cost a rejected draft,
    and subtracting uses the same keys as adding, so eviction stays exact. A context seen once
    maps to its follower (an int), not a dict: most deep contexts are seen once.
    """

    __slots__ = ("contexts", "max_depth")

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.contexts: dict[int, int | _Followers] = {}

    def count(self, tokens: Sequence[int], start: int, first: int, end: int, delta: int) -> None:
        """Add (``delta`` 1) or subtract (-1) what followed each context that begins at or
        after ``start``, for the followers at ``max(first, start + 1)`` .. ``end - 1``."""
        update = self._add if delta > 0 else self._discard
        depth = self.max_depth
        for position in range(max(first, start + 1), end):
            follower = tokens[position]
            window = tuple(tokens[max(start, position - depth) : position])
            for length in range(1, len(window) + 1):
                update(hash(window[-length:]), follower)

    def forget_contexts_at(self, tokens: Sequence[int], start: int, end: int) -> None:
        """Subtract the contexts that begin at ``start`` (the window moved past it), for the
        followers before ``end``."""
        for position in range(start + 1, min(start + self.max_depth, end - 1) + 1):
            self._discard(hash(tuple(tokens[start:position])), tokens[position])

    def match_length(self, context: Sequence[int]) -> int:
        """Length of the longest suffix of ``context`` (at most ``max_depth``) seen here.

        A seen context's suffixes were all seen (each occurrence ends one of theirs), so a
        binary search finds it in log2(max_depth) lookups."""
        low, high = 0, min(self.max_depth, len(context))
        while low < high:
            middle = (low + high + 1) // 2
            if hash(tuple(context[-middle:])) in self.contexts:
                low = middle
            else:
                high = middle - 1
        return low

    def predict(self, context: Sequence[int], length: int) -> tuple[int, float]:
        """The most frequent follower of the last ``length`` tokens of ``context`` (a seen
        context) and its share of that context's followers."""
        followers = self.contexts[hash(tuple(context[-length:]))]
        if isinstance(followers, int):
            return followers, 1.0
        token = followers.most_frequent()
        return token, followers[token] / followers.total

    def _add(self, key: int, token: int) -> None:
        followers = self.contexts.get(key)
        if followers is None:
            self.contexts[key] = token
        elif isinstance(followers, int):
            self.contexts[key] = _Followers(followers, token)
        else:
            followers.add(token)

    def _discard(self, key: int, token: int) -> None:
        followers = self.contexts[key]
        if isinstance(followers, int):
            del self.contexts[key]
            return
        followers.discard(token)
        if followers.total == 1:  # back to the form a context seen once has
            (self.contexts[key],) = followers


class _RequestIndex:
    """A request's tokens and the counts of its latest ``max_request_tokens`` of them.

    The copy of the tokens grows with the request (a pointer a token, as the request's own
    lists do); the counts, a thousand times larger a token, stay within the window.
    """

    __slots__ = ("counts", "end", "start", "tokens")

    def __init__(self, prompt: Sequence[int], max_depth: int) -> None:
        self.tokens: list[int] = list(prompt)
        self.counts = _ContextCounts(max_depth)
        self.start = 0
        """Counted contexts begin at or after this index (the window's start)."""
        self.end = 0
        """Followers before this index are counted."""


class SuffixProposer(Proposer):
    """Drafts the most frequent continuation of the request's longest matching suffix, from
    its own tokens and from recently finished requests (see the module docstring).

    A step costs O(new tokens x ``max_depth``) to index what a request gained, plus
    O(draft length x log2 ``max_depth``) lookups; :meth:`remove` costs O(output x
    ``max_depth``) to add the output to the corpus and as much to evict the oldest one.
    """

    def __init__(self, params: ProposerParams, options: SuffixOptions) -> None:
        super().__init__(params, options)
        self._indexes: dict[str, _RequestIndex] = {}
        self._corpus = _ContextCounts(options.max_depth)
        """Counts over the outputs of the finished requests in :attr:`_cached`."""
        self._cached: collections.deque[list[int]] = collections.deque()
        """The tokens each cached request added to the corpus, oldest first."""

    def propose(self, slots: Sequence[DraftSlot]) -> list[list[int]]:
        return [self._propose(slot.request, slot.max_tokens) for slot in slots]

    def remove(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)
        if self.options.max_cached_requests == 0:
            return
        window = self.options.max_request_tokens
        text = request.output_token_ids[-window:]
        if self.options.index_prompts and len(text) < window:
            # The prompt's tail only: a long prompt is never copied whole.
            text = request.prompt_token_ids[len(text) - window :] + text
        if len(text) < 2:
            return  # nothing followed anything
        self._corpus.count(text, 0, 1, len(text), 1)
        self._cached.append(text)
        if len(self._cached) > self.options.max_cached_requests:
            evicted = self._cached.popleft()
            self._corpus.count(evicted, 0, 1, len(evicted), -1)

    def _propose(self, request: Request, max_tokens: int) -> list[int]:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _RequestIndex(
                request.prompt_token_ids, self.options.max_depth
            )
        self._extend(index, request)
        depth = self.options.max_depth
        context = index.tokens[-depth:]
        draft: list[int] = []
        limit = max_tokens
        probability = 1.0
        while len(draft) < limit:
            own_length = index.counts.match_length(context)
            corpus_length = self._corpus.match_length(context) if self._cached else 0
            if own_length == 0 and corpus_length == 0:
                break
            if own_length >= corpus_length:
                token, share = index.counts.predict(context, own_length)
            else:
                token, share = self._corpus.predict(context, corpus_length)
            if not draft:
                matched = max(own_length, corpus_length)
                limit = min(max_tokens, int(matched * self.options.max_spec_factor))
                if limit == 0:
                    break
            probability *= share
            if probability < self.options.min_probability:
                break
            if not 0 <= token < self.params.vocab_size:
                break
            draft.append(token)
            context.append(token)
            if len(context) > depth:
                del context[0]
        return draft

    def _extend(self, index: _RequestIndex, request: Request) -> None:
        """Append the tokens ``request`` gained, slide the window, count the new followers."""
        tokens = index.tokens
        known_output = len(tokens) - request.num_prompt_tokens
        if request.num_output_tokens > known_output:
            tokens.extend(request.output_token_ids[known_output:])
        length = len(tokens)
        start = max(0, length - self.options.max_request_tokens)
        for old_start in range(index.start, min(start, index.end)):
            index.counts.forget_contexts_at(tokens, old_start, index.end)
        index.start = max(index.start, start)
        index.counts.count(tokens, index.start, index.end, length, 1)
        index.end = length
