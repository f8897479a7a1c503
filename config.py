"""The run's configuration: one dataclass of flags (each with its help text), parsed from the command line, with the
derived values computed and every value checked right after parsing; and what may change when a run is resumed.
"""
import argparse
import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from data import SPLITS, dataset_problem, load_split, task_of
from grader import grader_of, is_number
from model import DEFAULT_MODEL, model_problem, pick_device

TRACKERS = ("none", "tensorboard", "wandb")
MAX_RESAMPLE = 16  # --resample-silent: at most this many times --samples-per-prompt fresh responses per silent group


def arg(default, help, **kwargs):
    return field(default=default, metadata=dict(help=help, **kwargs))


@dataclass
class Config:
    dataset: str = arg("gsm8k", "gsm8k, math (both shipped in data/), arith (generated arithmetic word problems, "
                                "learnable on a CPU), or a folder of your own holding train.jsonl and test.jsonl, one "
                                '{"question": ..., "answer": <final answer>} per line ("solution" optional)')
    grader: str = arg("auto", "how responses are graded: number (the final number after '####', compared exactly: "
                              "grader.grade_gsm8k) or math (the last \\boxed{}, by math-verify: grader.grade_math); "
                              "auto: math for math, number for gsm8k and arith, and for a folder number if every "
                              "answer in it is a plain number, else math", choices=["auto", "number", "math"])
    estimator: str = arg("vine", "advantage estimator: vine (VinePPO), critic (PPO value head, GAE), grpo, rloo",
                         choices=["vine", "critic", "grpo", "rloo"])
    data_dir: str | None = arg(None, "gsm8k, math: a folder with <dataset>/{train,test}.jsonl, or hub (the Hugging "
                                     "Face Hub's copies); else $VINEPPO_DATA_DIR, else the copy shipped in data/")
    model: str = arg(DEFAULT_MODEL, "Hub id (offline: from the Hugging Face cache), local HF folder or .gguf file")
    prompt_format: str = arg("chat", "chat: the model's chat template; sft: the paper's '[MATH_TASK] Problem:' format; "
                                     "plain: the question and a newline (a model without a template)",
                             choices=["chat", "sft", "plain"])
    out_dir: str | None = arg(None, "where metrics.jsonl and checkpoints go (default "
                                    "runs/<dataset>-<estimator>-k<K>-s<seed>, a folder --dataset by its name)")
    seed: int = arg(0, "random seed (prompt order, sampling, minibatches)")
    iterations: int | None = arg(None, "PPO iterations (paper: 650 gsm8k, 1000 math; arith: 200; a folder: 650)")
    time_budget: float = arg(0.0, "stop once this many seconds of training (evaluation excluded) have passed; 0: none")
    arith_ops: int = arg(1, "arith: operations per problem (1: the base model starts near 17%% pass@1; 2: near 2%%)")
    arith_max: int = arg(20, "arith: largest starting number / addend")
    chain_filler: int = arg(0, "chain: filler lines '~x' (x a random tag the reward ignores) after the operation "
                               "lines: a longer horizon at the same arithmetic (data.make_chain)")
    prompts_per_iter: int | None = arg(None, "problems per iteration (paper: 64; CPU default: 4)")
    samples_per_prompt: int | None = arg(None, "responses per problem (paper: 8; CPU default: 4)")
    max_new_tokens: int | None = arg(None, "response length limit (paper: 1024; CPU default: 192)")
    k: int = arg(9, "K: vines (MC continuations) per state (paper: 9); with --k-mode budget, the mean per state")
    k_mode: str = arg("fixed", "vines per state: fixed (K each), adaptive (rounds of --k-round until the Wilson interval "
                               "is narrower than --k-ci, at most --k-max), budget (K x states in all, rounds to the "
                               "most uncertain states), official (the official repo's expander: 10, +4 up to 30)",
                      choices=["fixed", "adaptive", "budget", "official"])
    k_round: int = arg(3, "vines per state per round (adaptive, budget)")
    k_max: int = arg(27, "most vines per state (adaptive)")
    k_ci: float = arg(0.5, "adaptive: stop a state once its 95%% Wilson interval is narrower than this")
    free_samples: str = arg("off", "the group's own rollouts as samples of a state's value (values.py): off (the "
                                   "paper: K fresh vines only); add: K fresh vines plus the returns of the prompt's "
                                   "other responses through the state (leave-one-out); topup: fresh vines only where "
                                   "those fall short of K (--k-mode fixed only)",
                            choices=["off", "add", "topup"])
    vines_where: str = arg("all", "where vines are sampled (research/vines_where): all (the paper: every state of "
                                  "every response); silent: only for the responses whose group's others all got one "
                                  "reward (a silent group, or the one response that differs), the others take grpo's "
                                  "advantages", choices=["all", "silent"])
    resample_silent: int = arg(0, "grpo / rloo: this many fresh responses more to the prompt of every group whose "
                                  "responses all got the same reward, joined to its group (the comparator of "
                                  "--vines-where silent; 0: off); the update keeps its number of optimizer steps")
    temperature: float = arg(0.6, "sampling temperature for rollouts and vines")
    vine_temperature: float = arg(0.0, "sample the vines at this temperature instead (ablations/vine_temperature.py); "
                                       "0: --temperature, the paper's")
    top_p: float = arg(0.9, "nucleus sampling threshold")
    gamma: float = arg(1.0, "discount")
    lam: float | None = arg(None, "GAE lambda (default: 0 for vine, 1 for critic as in the paper's PPO)")
    clip: float = arg(0.2, "PPO clip range")
    kl_coef: float = arg(1e-4, "coefficient of the k3 KL penalty to the reference, in the loss")
    lr: float = arg(1e-6, "AdamW learning rate (linear warmup, then linear decay to 0)")
    lr_decay: bool = arg(True, "decay the lr linearly to 0 at --iterations (off: constant after warmup)")
    warmup_ratio: float = arg(0.03, "fraction of optimizer steps spent warming up")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    epochs: int = arg(2, "PPO epochs per iteration")
    minibatch_size: int | None = arg(None, "episodes per optimizer step (paper: 64; CPU default: 8)")
    micro_batch_size: int | None = arg(None, "episodes per forward/backward (gradient accumulation; CPU default: 2)")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    critic: str | None = arg(None, "--estimator critic's value network: separate (the paper's PPO: a copy of --model "
                                   "with a value head, trained by the value loss alone with its own AdamW at "
                                   "--value-lr; critic.py) or head (a value head on the policy's own trunk, its loss "
                                   "x --vf-coef in the policy's; the ablation). Default with --estimator critic: "
                                   "separate", choices=["separate", "head"])
    vf_coef: float = arg(0.1, "--critic head: weight of the value loss in the policy's loss")
    value_clip: float = arg(0.2, "critic: value clipping range")
    value_lr: float | None = arg(None, "critic: learning rate of the separate critic (its whole network) or of the "
                                       "head (default: --lr, as the official configuration)")
    whiten: bool = arg(True, "normalise advantages over the batch")
    max_value_steps: int | None = arg(None, "estimate at most this many states per response (default: no cap "
                                            "for math, 25 otherwise; 0 = no cap)")
    step_split: str = arg("auto", "where vines branch. auto: the dataset's text rule (math: sentences and math spans; "
                                  "gsm8k, arith, chain and a folder: lines); tokens:N: every N tokens; lowprob:P: "
                                  "before sampled tokens of probability < P (SPO: 0.9); entropy:F: before the top "
                                  "fraction F of tokens by policy entropy (0.2); lowprob and entropy keep at most the "
                                  "text rule's number of states per response")
    eval_every: int = arg(10, "evaluate every this many iterations (and before the first, and after the last)")
    eval_every_seconds: float = arg(0.0, "also evaluate, and checkpoint, each time training passes a multiple of "
                                         "this many seconds (evaluation excluded); 0: off")
    eval_size: int | None = arg(None, "test problems per evaluation (default: all on GPU; CPU default: 32)")
    eval_samples: int | None = arg(None, "samples per test problem, pass@1 = mean correctness (paper: 16; CPU: 4)")
    eval_temperature: float = arg(0.35, "sampling temperature for evaluation")
    eval_greedy: bool = arg(False, "also greedy pass@1 at each evaluation, beside the sampled one (logged as "
                                   "eval_greedy_accuracy)")
    save_every: int = arg(10, "write a checkpoint every this many iterations (and at the end, and on Ctrl-C)")
    resume: bool = arg(False, "continue from the last checkpoint in --out-dir")
    overwrite: bool = arg(False, "start afresh in an --out-dir that holds a run, deleting its checkpoints and metrics")
    sampler: str = arg("auto", "auto: vLLM if it imports and starts, else hf; hf: this project's own CPU/GPU decode "
                               "loop (engine/decoding.py), not transformers'; generate: transformers' generate; vllm",
                       choices=["auto", "hf", "generate", "vllm"])
    vllm_gpu_memory: float = arg(0.3, "vLLM: fraction of the GPU's memory the engine takes (weights, activations, KV "
                                      "cache); it starts before the policy and reference are loaded, and refuses to "
                                      "start unless that much is free")
    vllm_max_batched_tokens: int | None = arg(None, "vLLM: tokens per engine step, which sets its profiled activation "
                                                    "peak (default: 4096 on CUDA, as TRL; 65536 on vLLM's CPU build, "
                                                    "whose seeded sampling fails when a prefill is split over steps)")
    vllm_sleep: bool = arg(True, "vLLM on CUDA: sleep through the PPO update (weights offloaded to the CPU, KV cache "
                                 "freed), woken for the weight push and for generation")
    gen_batch_size: int = arg(256, "rows per generation batch (transformers samplers)")
    device: str = arg("auto", "auto, cpu or cuda")
    threads: int = arg(0, "CPU threads for torch's ops (0: torch's default, every core); 1 suits a tiny model, whose "
                          "ops are too small to share out (on a busy machine more threads can be far slower)")
    dtype: str = arg("auto", "compute dtype of training (autocast), the sampler and the reference; master weights and "
                             "AdamW stay fp32. auto: bf16 on CUDA and on CPUs with native bf16 (avx512_bf16 / AMX), "
                             "else fp32", choices=["auto", "float32", "bfloat16"])
    tis_cap: float = arg(0.0, "truncated importance sampling: weight each token's PPO loss by min(pi_old / "
                              "pi_sampler, C); 0: off")
    track: str = arg("none", "also log the metrics (and a few responses with their step advantages) to tensorboard "
                             "(<out-dir>/tb) or wandb (WANDB_MODE=offline works without a network)",
                     choices=TRACKERS)
    trust_remote_code: bool = arg(False, "allow model repositories to run their own code")
    fsdp: bool = arg(False, "under torchrun: shard weights, gradients and AdamW's state over ranks with FSDP2 "
                            "(off: DDP, every rank holds them all)")
    # Derived from --dataset by parse_config, not a flag: whose rules apply (data source, step splitting, defaults).
    task: str | None = field(default=None, metadata=dict(derived=True))  # gsm8k, math, arith, or custom: a folder
    total_steps: int | None = field(default=None, metadata=dict(derived=True))  # optimizer steps of the whole run


# --help in groups, the paper's flags first: group title -> the Config fields in it, in the order shown
GROUPS = {
    "the paper and its baselines": [
        "estimator", "k", "gamma", "lam", "clip", "kl_coef", "lr", "lr_decay", "warmup_ratio", "weight_decay", "epochs",
        "prompts_per_iter", "samples_per_prompt", "minibatch_size", "micro_batch_size", "max_grad_norm",
        "temperature", "top_p", "max_new_tokens", "max_value_steps", "whiten", "critic", "value_lr", "vf_coef",
        "value_clip", "iterations", "seed"],
    "data and model": ["dataset", "grader", "data_dir", "model", "prompt_format", "trust_remote_code", "arith_ops",
                       "arith_max", "chain_filler"],
    "ablations (ablations/)": ["k_mode", "k_round", "k_max", "k_ci", "free_samples", "vines_where", "resample_silent",
                               "vine_temperature", "step_split", "tis_cap"],
    "machine and precision": ["device", "dtype", "threads", "sampler", "gen_batch_size", "vllm_gpu_memory",
                              "vllm_max_batched_tokens", "vllm_sleep", "fsdp"],
    "evaluation, logging and checkpoints": ["eval_every", "eval_every_seconds", "eval_size", "eval_samples",
                                            "eval_temperature", "eval_greedy", "track", "out_dir", "save_every",
                                            "resume", "overwrite", "time_budget"],
}


def parse_dataclass(cls, argv=None, *, description: str | None = None, groups: dict[str, list[str]]):
    """(parser, an instance of the dataclass `cls` from argv): one flag per field (--some-name for some_name), its
    help text and choices from the field's `arg`, listed by --help under its group (`groups`: title -> field names,
    every flag in exactly one); fields marked derived are no flags. Checks and derived values are the caller's,
    reported with parser.error."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [flags] (--help lists every flag and its default)")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
    grouped = [name for names in groups.values() for name in names]
    if sorted(grouped) != sorted(fields):
        raise ValueError(f"{cls.__name__}: --help groups miss {sorted(set(fields) - set(grouped))} or repeat or "
                         f"invent {sorted(n for n in set(grouped) if grouped.count(n) > 1 or n not in fields)}")
    for title, names in groups.items():
        group = parser.add_argument_group(title)
        for f in (fields[n] for n in names):
            add_flag(group, f)
    return parser, cls(**vars(parser.parse_args(argv)))


def add_flag(group, f: dataclasses.Field):
    """One dataclass field as a flag of an argparse group."""
    name, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
    if f.default is not None:  # None defaults say in their text what they become
        meta["help"] += " (default: %(default)s)"
    if f.type is bool:
        group.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, **meta)
    else:  # `int | None` parses as int
        kind = next(t for t in getattr(f.type, "__args__", (f.type,)) if t is not type(None))
        group.add_argument(name, type=kind, default=f.default, **meta)


def derive_task(parser, cfg):
    """train.py's and sft.py's cfg.task from --dataset, and --grader auto's choice: by the task, or for a folder by
    its answers (all numbers: number, else math; reading it, a malformed row stops here, as file:line)."""
    problem = dataset_problem(cfg.dataset)
    if problem:
        parser.error(f"--dataset {cfg.dataset}: {problem}")
    cfg.task = task_of(cfg.dataset)
    if cfg.grader == "auto" and cfg.task == "custom":
        answers = [e["answer"] for split in SPLITS for e in load_split(cfg.dataset, split)]
        cfg.grader = "number" if all(map(is_number, answers)) else "math"
    elif cfg.grader == "auto":
        cfg.grader = grader_of(cfg.task)


def check_shared(parser, cfg, *, at_least_1: tuple[str, ...]):
    """The checks train.py and sft.py share: the counts `at_least_1`, --threads, --chain-filler, --eval-temperature,
    --top-p, --lr, --warmup-ratio, --resume against --overwrite, and a writable --out-dir."""
    for name in at_least_1:
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(cfg, name)})")
    if cfg.threads < 0:
        parser.error(f"--threads must be 0 (torch's default) or above (got {cfg.threads})")
    if cfg.chain_filler < 0 or cfg.chain_filler and cfg.dataset != "chain":
        parser.error(f"--chain-filler takes 0 or more filler lines, with --dataset chain only (got {cfg.chain_filler} "
                     f"with --dataset {cfg.dataset})")
    if not cfg.eval_temperature >= 0:
        parser.error(f"--eval-temperature must be 0 (greedy) or above (got {cfg.eval_temperature})")
    if not 0 < cfg.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1] (got {cfg.top_p})")
    if not cfg.lr > 0:
        parser.error(f"--lr must be above 0 (got {cfg.lr})")
    if not 0 <= cfg.warmup_ratio < 1:
        parser.error(f"--warmup-ratio must be in [0, 1) (got {cfg.warmup_ratio})")
    if cfg.resume and cfg.overwrite:
        parser.error("--resume and --overwrite contradict each other")
    problem = unwritable(Path(cfg.out_dir))
    if problem:
        parser.error(f"--out-dir {cfg.out_dir}: {problem}")


def parse_config(argv=None) -> Config:
    parser, cfg = parse_dataclass(Config, argv, description=__doc__, groups=GROUPS)
    # Derived values: what the data set is and how it is graded; paper sizes on a GPU, CPU sizes otherwise.
    derive_task(parser, cfg)
    gpu = pick_device(cfg.device).type == "cuda"
    for name, paper, cpu in (("prompts_per_iter", 64, 4), ("samples_per_prompt", 8, 4), ("max_new_tokens", 1024, 192),
                             ("minibatch_size", 64, 8), ("micro_batch_size", 8, 2), ("eval_samples", 16, 4)):
        if getattr(cfg, name) is None:
            setattr(cfg, name, paper if gpu else cpu)
    if cfg.iterations is None:
        cfg.iterations = {"gsm8k": 650, "math": 1000, "arith": 200, "chain": 100, "custom": 650}[cfg.task]
    if cfg.critic is not None and cfg.estimator != "critic":
        parser.error(f"--critic {cfg.critic} chooses the value network of --estimator critic (got --estimator "
                     f"{cfg.estimator})")
    if cfg.estimator == "critic" and cfg.critic is None:
        cfg.critic = "separate"  # the paper's PPO
    if cfg.lam is None:
        cfg.lam = 1.0 if cfg.estimator == "critic" else 0.0
    cfg.value_lr = cfg.lr if cfg.value_lr is None else cfg.value_lr
    if cfg.eval_size is None:
        cfg.eval_size = 10**9 if gpu else 32
    if cfg.vllm_max_batched_tokens is None:
        cfg.vllm_max_batched_tokens = 4096 if gpu else 65536
    if cfg.max_value_steps is None:
        cfg.max_value_steps = 0 if cfg.task == "math" else 25
    stem = Path(cfg.dataset).expanduser().resolve().name if cfg.task == "custom" else cfg.dataset
    cfg.out_dir = cfg.out_dir or f"runs/{stem}-{cfg.estimator}-k{cfg.k}-s{cfg.seed}"
    check_shared(parser, cfg, at_least_1=("iterations", "prompts_per_iter", "samples_per_prompt", "max_new_tokens", "k",
                                          "epochs", "arith_ops", "arith_max", "k_round", "k_max", "minibatch_size",
                                          "micro_batch_size", "eval_every", "eval_size", "eval_samples", "save_every",
                                          "gen_batch_size"))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # ranks under torchrun; the batch flags are global
    if cfg.prompts_per_iter % world:
        parser.error(f"--prompts-per-iter ({cfg.prompts_per_iter}) must be a multiple of the number of ranks ({world})")
    if cfg.minibatch_size % (world * cfg.micro_batch_size):
        parser.error(f"--minibatch-size ({cfg.minibatch_size}) must be a multiple of --micro-batch-size "
                     f"({cfg.micro_batch_size}) x the number of ranks ({world})")
    for name in ("value_lr", "clip"):
        if not getattr(cfg, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0 (got {getattr(cfg, name)})")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(cfg, name) <= 1:
            parser.error(f"--{name} must be in [0, 1] (got {getattr(cfg, name)})")
    if not cfg.kl_coef >= 0:
        parser.error(f"--kl-coef must be 0 (off) or above (got {cfg.kl_coef})")
    if cfg.estimator in ("grpo", "rloo") and cfg.samples_per_prompt < 2:
        parser.error(f"--estimator {cfg.estimator} compares each response with the others of its problem: it needs "
                     f"--samples-per-prompt 2 or more (got {cfg.samples_per_prompt})")
    if not cfg.eval_every_seconds >= 0:
        parser.error(f"--eval-every-seconds must be 0 (off) or above (got {cfg.eval_every_seconds})")
    if not 0 < cfg.vllm_gpu_memory < 1:
        parser.error(f"--vllm-gpu-memory must be a fraction in (0, 1) (got {cfg.vllm_gpu_memory})")
    if cfg.vllm_max_batched_tokens < 1:
        parser.error(f"--vllm-max-batched-tokens must be at least 1 (got {cfg.vllm_max_batched_tokens})")
    if not cfg.k_ci > 0:
        parser.error(f"--k-ci must be above 0 (got {cfg.k_ci})")
    if cfg.free_samples != "off" and cfg.estimator != "vine":
        parser.error(f"--free-samples {cfg.free_samples} feeds vines, which --estimator {cfg.estimator} does not "
                     f"sample: drop it, or use --estimator vine")
    if cfg.vines_where != "all" and cfg.estimator != "vine":
        parser.error(f"--vines-where {cfg.vines_where} says where to sample vines, which --estimator {cfg.estimator} "
                     f"does not sample: drop it, or use --estimator vine")
    if cfg.resample_silent < 0 or cfg.resample_silent and (cfg.estimator not in ("grpo", "rloo") or world > 1):
        parser.error(f"--resample-silent takes 0 (off) or more fresh responses, with --estimator grpo or rloo on one "
                     f"process (got {cfg.resample_silent} with --estimator {cfg.estimator}, {world} rank(s))")
    if cfg.resample_silent > MAX_RESAMPLE * cfg.samples_per_prompt:  # a typo's extra zeros would sample for hours
        parser.error(f"--resample-silent takes at most {MAX_RESAMPLE} x --samples-per-prompt = "
                     f"{MAX_RESAMPLE * cfg.samples_per_prompt} fresh responses per silent group (got "
                     f"{cfg.resample_silent}): with every group silent the batch would grow past "
                     f"{MAX_RESAMPLE + 1} times its {cfg.prompts_per_iter} x {cfg.samples_per_prompt} episodes")
    if cfg.free_samples != "off" and cfg.vines_where == "silent":
        parser.error(f"--free-samples {cfg.free_samples} with --vines-where silent: in a vined group the other "
                     f"responses through a state got the group's reward by selection, so as free samples they would "
                     f"pull every value toward it; drop one of the two")
    if cfg.free_samples == "topup" and cfg.k_mode != "fixed":
        parser.error(f"--free-samples topup takes --k-mode fixed only (got {cfg.k_mode}): with adaptive or official "
                     f"K, how many vines a state gets would depend on the rewards of the responses whose values they "
                     f"set (a bias, research/free_samples); budget shares vines over all states, not state by state")
    if cfg.tis_cap != 0 and cfg.tis_cap < 1:
        parser.error(f"--tis-cap must be 0 (off) or at least 1 (got {cfg.tis_cap})")
    if not cfg.temperature > 0:
        parser.error(f"--temperature must be above 0: rollouts and vines are sampled (got {cfg.temperature})")
    if not cfg.vine_temperature >= 0:
        parser.error(f"--vine-temperature must be 0 (--temperature) or above (got {cfg.vine_temperature})")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # restarted by torchrun --max-restarts: go on
        has_checkpoint = (Path(cfg.out_dir) / "latest").exists()
        cfg.resume, cfg.overwrite = has_checkpoint, not has_checkpoint
    problem = tracker_missing(cfg.track)
    if problem:
        parser.error(problem)
    problem = step_split_problem(cfg.step_split)
    if problem:
        parser.error(f"--step-split {cfg.step_split!r}: {problem}")
    problem = model_problem(cfg.model)  # last: offline, a Hub id may take the Hub's 3 s check
    if problem:
        parser.error(f"--model {cfg.model}: {problem}")
    cfg.total_steps = cfg.iterations * cfg.epochs * math.ceil(cfg.prompts_per_iter * cfg.samples_per_prompt /
                                                              cfg.minibatch_size)  # the lr schedule's length
    return cfg


def step_split_problem(split: str) -> str | None:
    """What is wrong with a --step-split value (None if nothing): auto, tokens:N (N >= 1), lowprob:P or entropy:F
    (0 < P, F <= 1)."""
    rule, colon, arg = split.partition(":")
    if split == "auto" or rule == "tokens" and arg.isdigit() and int(arg) >= 1:
        return None
    if rule in ("lowprob", "entropy") and colon:
        try:
            if 0 < float(arg) <= 1:
                return None
        except ValueError:
            pass
        return f"{rule} takes a number in (0, 1] after the colon"
    return "must be auto, tokens:N (N >= 1), lowprob:P or entropy:F"


def tracker_missing(kind: str) -> str | None:
    """Why --track `kind` cannot run here, or None (checked at parse time, before anything is written)."""
    if kind != "none" and importlib.util.find_spec(kind) is None:  # the package is named like the tracker
        return f"--track {kind} needs the `{kind}` package (pip install {kind})"
    return None


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be (or become) a writable folder, or None."""
    if path.exists() and not path.is_dir():
        return "exists and is not a folder"
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


# Flags that define a run: a resumed run must have the same. Every other flag may change on --resume (iterations,
# cadences, time budget, learning rates, ...) and is then applied for real and logged.
RUN_DEFINING = ("dataset", "grader", "estimator", "critic", "model", "prompt_format", "seed", "arith_ops", "arith_max",
                "chain_filler", "k",
                "prompts_per_iter", "samples_per_prompt", "max_new_tokens", "minibatch_size", "epochs", "gamma", "lam",
                "max_value_steps", "step_split", "eval_size", "eval_samples", "fsdp", "k_mode", "k_round",
                "k_max", "k_ci", "free_samples", "vines_where", "resample_silent", "vine_temperature")
NOT_COMPARED = ("out_dir", "data_dir", "resume", "overwrite", "track", "task", "total_steps")  # derived


def changed_flags(saved: dict, cfg, names: tuple[str, ...]) -> list[str]:
    """The flags `names` whose value in a checkpoint's config (`saved`) differs from cfg's, as "--flag a -> b" (sft.py's
    run-defining flags; train.py's: config_changes)."""
    return [f"--{k.replace('_', '-')} {saved.get(k)} -> {getattr(cfg, k)}" for k in names
            if saved.get(k) != getattr(cfg, k)]


def config_changes(saved: dict, cfg: Config) -> tuple[list[str], list[str]]:
    """(run-defining differences, other differences) between a checkpoint's config and this one, as "--flag a -> b"."""
    defining, other = [], []
    saved = {"grader": grader_of(saved.get("dataset", "gsm8k")),  # checkpoints from before --grader, and from
             "critic": "head" if saved.get("estimator") == "critic" else None, **saved}  # before --critic: a head
    for f in dataclasses.fields(Config):
        old, new = saved.get(f.name, f.default), getattr(cfg, f.name)
        if f.name not in NOT_COMPARED and old != new:
            (defining if f.name in RUN_DEFINING else other).append(f"--{f.name.replace('_', '-')} {old} -> {new}")
    return defining, other
