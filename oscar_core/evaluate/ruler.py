"""RULER-style long-context tasks (after Hsieh et al., RULER, arXiv 2404.06654), generated offline from a seed.

A prompt is token ids [≤ L]: the tokenizer's bos_prefix, an instruction, a haystack with pieces hidden in it, the
question and the start of the answer. Pieces are tokenized apart and joined id by id, so the needle tasks and variable
tracking fill L exactly and common words fills it to within one list item. The haystack is L − (everything else)
consecutive tokens of shipped held-out text from a random offset; the pieces sit at sorted random offsets in it.
    niah_single        one needle "One of the special magic numbers for {key} is: {value}."; asked: its value
    niah_multikey      NEEDLES needles of NEEDLES keys; asked: the value of one
    niah_multivalue    NEEDLES needles of one key with NEEDLES values; asked: all its values
    niah_multiquery    NEEDLES needles of NEEDLES keys; asked: the values of all
    variable_tracking  CHAINS chains "VAR A = 12345." "VAR B = VAR A." ... of HOPS hops, statements of a chain in
                       order, chains interleaved; asked: the HOPS + 1 variables that hold one chain's value
    common_words       (no haystack) a numbered list of words of the text: COMMON words f_c times each, the others
                       f_u times (f_c = 30% of the list / COMMON within [3, 30], f_u = max(1, f_c // 10)); asked:
                       the COMMON most common
Keys are two words of the text joined by a hyphen, values 7-digit numbers, variables 5 capital letters.
Score (RULER's string_match_all): the fraction of expected strings found in the answer, case-insensitive; one
expected string (niah_single, niah_multikey) scores 0 or 1.
"""

import random
import re
from dataclasses import dataclass

import torch

from oscar_core.calibrate.data import bos_prefix
from oscar_core.errors import OscarError
from oscar_core.evaluate.perplexity import encode, heldout_tokens

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words")
NEEDLES, CHAINS, HOPS, COMMON = 4, 2, 4, 10
HAYSTACK_TOKENS = 65536
ANSWER_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "niah_multiquery": 48,
                 "variable_tracking": 32, "common_words": 48}
NIAH = {"niah_single": (1, 1, 1), "niah_multikey": (NEEDLES, 1, 1),   # keys, values per key, keys asked
        "niah_multivalue": (1, NEEDLES, 1), "niah_multiquery": (NEEDLES, 1, NEEDLES)}

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n")
NEEDLE = "\nOne of the special magic numbers for {key} is: {value}.\n"
ASK_ONE = ("\nWhat is the special magic number for {keys} mentioned in the provided text? "
           "The special magic number for {keys} mentioned in the provided text is")
ASK_ALL = ("\nWhat are all the special magic numbers for {keys} mentioned in the provided text? "
           "The special magic numbers for {keys} mentioned in the provided text are")
VT_INTRO = "Memorize and track the chains of variable assignment hidden in the following text.\n"
STATEMENT = "\nVAR {name} = {source}.\n"
VT_ASK = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: According "
          "to the chains of variable assignment in the text above, {n} variables are assigned the value {value}, "
          "they are:")
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n")
CWE_ASK = (f"\nQuestion: What are the {COMMON} most common words in the above list? "
           f"Answer: The top {COMMON} words that appear most often in the list are:")


class DoesNotFit(OscarError):
    """A task's prompt without its haystack does not fit the context."""


@dataclass(frozen=True)
class Haystack:
    """Shipped text to hide pieces in: its token stream and its distinct lower-case words of 4 to 10 letters."""
    name: str
    tokens: torch.Tensor
    words: tuple[str, ...]

    def span(self, n: int, rng: random.Random) -> torch.Tensor:
        """n consecutive tokens from a random offset, wrapping around the end; an error if the text is shorter."""
        if self.tokens.numel() < n:
            raise OscarError(f"data source {self.name} holds {self.tokens.numel()} tokens, fewer than the {n} of "
                             f"haystack a prompt needs")
        start = rng.randrange(self.tokens.numel())
        return torch.cat([self.tokens[start:], self.tokens[:start]])[:n]

    def pick(self, k: int, rng: random.Random) -> list[str]:
        """k distinct words in random order; an error if the text holds fewer."""
        if len(self.words) < k:
            raise OscarError(f"data source {self.name} holds {len(self.words)} distinct words, fewer than {k}")
        return rng.sample(self.words, k)


@dataclass(frozen=True)
class Sample:
    """One prompt: ids [≤ L], the strings its answer should hold, where each hidden piece starts in ids."""
    task: str
    ids: torch.Tensor
    expected: tuple[str, ...]
    starts: tuple[int, ...]

    @property
    def max_new_tokens(self) -> int:
        return ANSWER_TOKENS[self.task]


def haystack(source: str, tokenizer, length: int) -> Haystack:
    """The first max(length, HAYSTACK_TOKENS) tokens of a source (fewer if it is shorter; the default held-out text
    is about 43K), its documents joined by a blank line rather than EOS (no prompt holds an end of text), and the
    words of that text: prompts of every length draw their haystacks from all of it."""
    stream, blank = heldout_tokens(source, tokenizer, max(length, HAYSTACK_TOKENS)).tolist(), encode(tokenizer, "\n\n")
    tokens = torch.tensor([t for i in stream for t in (blank.tolist() if i == tokenizer.eos_token_id else [i])])
    words = sorted(set(re.findall(r"\b[a-z]{4,10}\b", tokenizer.decode(tokens.tolist()))))
    return Haystack(source, tokens, tuple(words))


def string_match_all(answer: str, expected: tuple[str, ...] | list[str]) -> float:
    """RULER's string_match_all: the fraction of expected strings that occur in the answer, case-insensitive."""
    text = answer.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


def hide(task: str, head: torch.Tensor, pieces: list[torch.Tensor], tail: torch.Tensor, hay: Haystack, length: int,
         rng: random.Random) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(ids [length], start of each piece in ids): head, a haystack of n = length − |head| − Σ|pieces| − |tail|
    tokens with the pieces in order at sorted random offsets, tail. DoesNotFit where the haystack would be shorter than
    the pieces."""
    hidden = sum(p.numel() for p in pieces)
    n = length - head.numel() - hidden - tail.numel()
    if n < hidden:
        raise DoesNotFit(f"{task} needs at least {length - n + hidden} tokens (its prompt without haystack holds "
                         f"{length - n})")
    filler = hay.span(n, rng)
    offsets = sorted(rng.randint(0, n) for _ in pieces)
    parts, starts, at = [head], [], 0
    for offset, piece in zip(offsets, pieces):
        parts.append(filler[at:offset])
        starts.append(sum(p.numel() for p in parts))
        parts.append(piece)
        at = offset
    parts += [filler[at:], tail]
    return torch.cat(parts), tuple(starts)


def opening(tokenizer, intro: str) -> torch.Tensor:
    """The tokenizer's bos_prefix, then the instruction."""
    return torch.cat([torch.tensor(bos_prefix(tokenizer), dtype=torch.long), encode(tokenizer, intro)])


def listing(names: list[str]) -> str:
    """'a', 'a and b', 'a, b, and c'."""
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + ("," if len(names) > 2 else "") + " and " + names[-1]


def niah(task: str, tokenizer, hay: Haystack, length: int, rng: random.Random) -> Sample:
    """A needle task of NIAH[task] = (keys, values per key, keys asked)."""
    n_keys, n_values, n_asked = NIAH[task]
    words = hay.pick(2 * n_keys, rng)
    keys = [f"{a}-{b}" for a, b in zip(words[::2], words[1::2])]
    values = iter(str(v) for v in rng.sample(range(10**6, 10**7), n_keys * n_values))
    needles = [(k, next(values)) for k in keys for _ in range(n_values)]
    rng.shuffle(needles)
    asked = keys[:n_asked]
    ask = ASK_ONE if n_asked * n_values == 1 else ASK_ALL
    pieces = [encode(tokenizer, NEEDLE.format(key=k, value=v)) for k, v in needles]
    ids, starts = hide(task, opening(tokenizer, NIAH_INTRO), pieces, encode(tokenizer, ask.format(keys=listing(asked))),
                       hay, length, rng)
    return Sample(task, ids, tuple(v for k, v in needles if k in asked), starts)


def variable_tracking(tokenizer, hay: Haystack, length: int, rng: random.Random) -> Sample:
    """CHAINS chains of HOPS assignments each, interleaved in the haystack; asked: the variables of the first."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = set()
    while len(names) < CHAINS * (HOPS + 1):
        names.add("".join(rng.choice(letters) for _ in range(5)))
    names = rng.sample(sorted(names), len(names))
    chains = [names[c * (HOPS + 1):(c + 1) * (HOPS + 1)] for c in range(CHAINS)]
    values = [str(v) for v in rng.sample(range(10**4, 10**5), CHAINS)]
    statements = [[STATEMENT.format(name=chain[0], source=value)]
                  + [STATEMENT.format(name=chain[h], source=f"VAR {chain[h - 1]}") for h in range(1, HOPS + 1)]
                  for chain, value in zip(chains, values)]
    order = [c for c in range(CHAINS) for _ in range(HOPS + 1)]
    rng.shuffle(order)
    pieces = [encode(tokenizer, statements[c].pop(0)) for c in order]
    tail = encode(tokenizer, VT_ASK.format(value=values[0], n=HOPS + 1))
    ids, starts = hide("variable_tracking", opening(tokenizer, VT_INTRO), pieces, tail, hay, length, rng)
    return Sample("variable_tracking", ids, tuple(chains[0]), starts)


def common_words(tokenizer, hay: Haystack, length: int, rng: random.Random) -> Sample:
    """A numbered list "\\n1. word\\n2. word ..." as long as fits: COMMON words f_c times, then further words f_u
    times each while the list fits, shuffled. DoesNotFit where fewer than COMMON further words fit; an error where the
    text runs out of distinct words first."""
    head, tail = opening(tokenizer, CWE_INTRO), encode(tokenizer, CWE_ASK)
    budget = length - head.numel() - tail.numel()
    pool = hay.pick(len(hay.words), rng)
    spelled = {w: encode(tokenizer, f" {w}") for w in pool[:COMMON]}
    numbers, used = [], [0]  # numbers[i]: the tokens of "\n{i + 1}."; used[i]: of the first i numbers

    def cost(items: int, word_tokens: int) -> int:
        while len(numbers) < items:
            numbers.append(encode(tokenizer, f"\n{len(numbers) + 1}."))
            used.append(used[-1] + numbers[-1].numel())
        return used[items] + word_tokens

    per_item = encode(tokenizer, f"\n{max(1, budget // 8)}.").numel() + max(1, round(
        sum(w.numel() for w in spelled.values()) / COMMON))
    f_c = min(30, max(3, round(0.3 * budget / per_item / COMMON)))
    f_u = max(1, f_c // 10)
    items = list(spelled) * f_c
    spent = f_c * sum(w.numel() for w in spelled.values())
    for w in pool[COMMON:]:
        spelled[w] = encode(tokenizer, f" {w}")
        if cost(len(items) + f_u, spent + f_u * spelled[w].numel()) > budget:
            break
        items += [w] * f_u
        spent += f_u * spelled[w].numel()
    else:
        raise OscarError(f"data source {hay.name} holds {len(pool)} distinct words, too few for a common-words list "
                         f"of {length} tokens")
    if len(items) < (f_c + f_u) * COMMON:
        raise DoesNotFit(f"common_words needs more than {length} tokens (a list of {COMMON} words {f_c} times each "
                         f"and {COMMON} others {f_u} times, and the question)")
    rng.shuffle(items)
    body = [t for i, w in enumerate(items) for t in (numbers[i], spelled[w])]
    return Sample("common_words", torch.cat([head, *body, tail]), tuple(pool[:COMMON]), ())


def sample(task: str, tokenizer, hay: Haystack, length: int, seed: int, index: int) -> Sample:
    """Prompt `index` of a task at a length; the same (task, length, seed, index) always gives the same prompt."""
    rng = random.Random(f"{seed}/{task}/{length}/{index}")
    if task in NIAH:
        return niah(task, tokenizer, hay, length, rng)
    if task == "variable_tracking":
        return variable_tracking(tokenizer, hay, length, rng)
    return common_words(tokenizer, hay, length, rng)
