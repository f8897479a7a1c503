"""A picture of credit assignment: one sampled response, each step coloured by its advantage.

    python -m scripts.visualize --model runs/arith-vine-k9-s0/ckpt-000020 --dataset arith --out credit

Samples a group of responses to one test problem (the first problem whose group has both right and wrong answers),
estimates VinePPO's step values with K vines, and renders the response whose steps get the most different credit:
under VinePPO each step has its own advantage A_i = V(after) - V(before) (+ the reward on the last step); under GRPO
the whole response gets one, (r - group mean) / group std. Writes credit.html and credit.png into --out.
"""
import argparse
import html
from pathlib import Path

import torch

from advantages import gae, group_baseline_advantages, step_rewards
from data import encode_prompt, load_split
from engine import HFSampler
from grader import grade
from model import load_model, load_tokenizer
from values import estimate_values, step_token_starts


def colour(advantage: float, scale: float) -> str:
    """Green for positive, red for negative, white for zero; `scale` maps to full colour."""
    x = max(-1.0, min(1.0, advantage / scale)) if scale > 0 else 0.0
    r, g, b = (255, int(255 * (1 + x)), int(255 * (1 + x))) if x < 0 else (int(255 * (1 - x)), 255, int(255 * (1 - x)))
    return f"#{r:02x}{g:02x}{b:02x}"


def credit_example(sampler, tokenizer, examples, *, dataset: str, n: int, K: int, max_new_tokens: int, seed: int,
                   temperature: float = 0.6, top_p: float = 0.9) -> dict:
    """Find a problem whose group has mixed rewards; return one response's steps with both estimators' credit."""
    for number, example in enumerate(examples[:50]):
        prompt = encode_prompt(example["question"], grader=dataset, tokenizer=tokenizer)
        group = sampler.sample([prompt], n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                               seed=seed + number)[0]
        rewards = [grade(s.text, example["answer"], grader=dataset, truncated=not s.finished) for s in group]
        if 0 < sum(rewards) < n:
            break
    starts = [step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, task=dataset) for s in group]
    values, _ = estimate_values(sampler=sampler, prompts=[prompt] * n, responses=[s.token_ids for s in group],
                                step_starts=starts, rewards=rewards, answers=[example["answer"]] * n, grader=dataset,
                                K=K, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    step_adv = [gae(step_rewards(len(v) - 1, r), torch.tensor(v), gamma=1.0, lam=0.0).tolist()
                for v, r in zip(values, rewards)]
    grpo = [a[0].item() for a in group_baseline_advantages(rewards=rewards, groups=[0] * n, lengths=[1] * n,
                                                             kind="grpo")]
    pick = max(range(n), key=lambda i: max(step_adv[i]) - min(step_adv[i]))  # the most varied credit
    bounds = starts[pick] + [len(group[pick].token_ids)]
    steps = [tokenizer.decode(group[pick].token_ids[a:b], skip_special_tokens=True) for a, b in zip(bounds, bounds[1:])]
    return {"question": example["question"], "answer": example["answer"], "reward": rewards[pick], "steps": steps,
            "values": values[pick], "vine": step_adv[pick], "grpo": grpo[pick], "group_rewards": rewards, "K": K}


def render_html(ex: dict) -> str:
    scale = max([abs(a) for a in ex["vine"]] + [abs(ex["grpo"]), 1e-6])
    rows = []
    for name, advs in (("VinePPO", ex["vine"]), ("GRPO", [ex["grpo"]] * len(ex["steps"]))):
        cells = []
        for i, (step, adv) in enumerate(zip(ex["steps"], advs)):
            note = f"V {ex['values'][i]:.2f} &rarr; {ex['values'][i + 1]:.2f}, A = {adv:+.2f}" if name == "VinePPO" \
                else f"A = {adv:+.2f} (one value for the whole response)"
            cells.append(f'<div class="step" style="background:{colour(adv, scale)}"><pre>{html.escape(step)}</pre>'
                         f'<span class="note">{note}</span></div>')
        rows.append(f'<div class="col"><h2>{name}</h2>{"".join(cells)}</div>')
    return f"""<!doctype html><meta charset="utf-8"><title>credit assignment</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}} .cols{{display:flex;gap:24px}}
.col{{flex:1}} .step{{border:1px solid #999;margin:4px 0;padding:4px}} pre{{margin:0;white-space:pre-wrap}}
.note{{font-size:12px;color:#333}}</style>
<h1>Credit assignment on one response</h1>
<p><b>Problem:</b> {html.escape(ex['question'])}<br><b>Gold answer:</b> {html.escape(ex['answer'])};
<b>this response's reward:</b> {ex['reward']:.0f}; group rewards: {ex['group_rewards']}; K = {ex['K']} vines per
state. Green: the step raised the chance of success; red: it lowered it.</p>
<div class="cols">{''.join(rows)}</div>"""


def render_png(ex: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    scale = max([abs(a) for a in ex["vine"]] + [abs(ex["grpo"]), 1e-6])
    n = len(ex["steps"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.9 * n + 1.2))
    for ax, name, advs in ((axes[0], "VinePPO", ex["vine"]), (axes[1], "GRPO", [ex["grpo"]] * n)):
        ax.set_axis_off()
        ax.set_title(f"{name} (reward {ex['reward']:.0f})")
        for i, (step, adv) in enumerate(zip(ex["steps"], advs)):
            label = step.strip()[:70] + f"\nA = {adv:+.2f}" + (
                f"   V {ex['values'][i]:.2f} -> {ex['values'][i + 1]:.2f}" if name == "VinePPO" else "")
            ax.text(0.01, 1 - (i + 0.5) / n, label, va="center", fontsize=8, family="monospace",
                    bbox=dict(facecolor=colour(adv, scale), edgecolor="#999"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a ckpt-* folder of train.py, or any model spec")
    parser.add_argument("--dataset", default="arith", choices=["gsm8k", "math", "arith"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--k", type=int, default=9)
    parser.add_argument("--samples", type=int, default=4, help="responses in the group (GRPO's baseline)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="credit")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, device=torch.device("cpu"), dtype=torch.float32, frozen=True)
    examples = load_split(args.dataset, "test", data_dir=args.data_dir)
    ex = credit_example(HFSampler(model, tokenizer), tokenizer, examples, dataset=args.dataset, n=args.samples,
                        K=args.k, max_new_tokens=args.max_new_tokens, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "credit.html").write_text(render_html(ex))
    render_png(ex, out / "credit.png")
    print(f"wrote {out / 'credit.html'} and {out / 'credit.png'}")


if __name__ == "__main__":
    main()
