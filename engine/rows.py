"""What both decode loops (engine/static.py, engine/continuous.py) do with rows, a row being one continuation of one
state: find the distinct sequences the rows continue, each prefilled once (distinct_sequences); decide when a row is
done and cut it into a Sample (StopRule); count finished rows and generated tokens on a progress bar (show_progress).
"""
from dataclasses import dataclass

from sampling import Sample, cut_at_stop


@dataclass
class StopRule:
    """When a row stops: a stop token (`ids`), a stop string (`strings`, found by decoding with `tokenizer`), or its
    budget."""
    ids: set[int]
    strings: list[str]
    tokenizer: object

    def finished(self, ids: list[int], budget: int) -> bool:
        """Is a row that has generated `ids` done: a stop token, its budget, or a stop string in its last tokens?"""
        return ids[-1] in self.ids or len(ids) >= budget or bool(self.strings) and any(
            stop in self.tokenizer.decode(ids[-16:]) for stop in self.strings)

    def cut(self, ids: list[int], logprobs: list[float], budget: int) -> Sample:
        """A finished row's Sample: its tokens up to the stop token or stop string, at most `budget` of them."""
        return cut_at_stop(ids, logprobs=logprobs, tokenizer=self.tokenizer, stop_ids=self.ids,
                           stop_strings=self.strings, limit=budget)


def distinct_sequences(sequences, prefix_lens, *, states: list[int], reuse: bool):
    """The parents of `states`: each distinct sequence once (every state its own if not reuse), with the longest
    prefix of it that a state needs. Returns (parent of each state (a dict), parents' tokens, needed lengths)."""
    index, parent_of, parents = {}, {}, []
    for i in states:
        key = tuple(sequences[i]) if reuse else i
        if key not in index:
            index[key] = len(parents)
            parents.append(list(sequences[i]))
        parent_of[i] = index[key]
    need = [0] * len(parents)
    for i in states:
        need[parent_of[i]] = max(need[parent_of[i]], prefix_lens[i])
    return parent_of, parents, need


def show_progress(bar, *, tokens: int, rows: int):
    """A tqdm bar counting rows, with the tokens generated so far and their rate (redraws at most every 0.1 s)."""
    bar.tokens = getattr(bar, "tokens", 0) + tokens
    bar.set_postfix_str(f"{bar.tokens} tokens, {bar.tokens / max(bar.format_dict['elapsed'], 1e-3):.0f} tok/s",
                        refresh=False)
    bar.update(rows)
