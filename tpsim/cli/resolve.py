"""`tpsim resolve`: layer ids -> positions, without running a model."""

from __future__ import annotations

from tpsim.capture import CONVENTIONS, check_convention, ids_for, resolve
from tpsim.cli.options import add_json, emit_json, layer_ids, positive_int
from tpsim.config import load_config
from tpsim.errors import UsageError
from tpsim.run.spec import model_path


def add_parser(sub) -> None:
    p = sub.add_parser("resolve", help="layer ids -> positions, without running a model")
    p.add_argument("--convention", required=True, type=check_convention,
                   metavar="{" + ",".join(CONVENTIONS) + "}")
    p.add_argument("--layers", help="layer ids, e.g. --layers=-1,2,30 (default: the convention's default)")
    p.add_argument("--num-layers", help="num_hidden_layers of the model")
    p.add_argument("--model", help="or read num_hidden_layers from this config")
    add_json(p, cmd_resolve)


def cmd_resolve(args) -> int:
    if args.num_layers is None and args.model is None:
        raise UsageError("resolve needs --num-layers L or --model M")
    if args.num_layers is not None and args.model is not None:
        raise UsageError("--num-layers and --model both give the layer count; give one of them")
    L = positive_int(args.num_layers, "--num-layers") if args.num_layers is not None \
        else load_config(model_path(args.model)).num_hidden_layers
    res = resolve(args.convention, layer_ids(args), L)
    equivalents = {}
    for conv in ("sglang", "sglang-boundary", "vllm", "specforge", "hf", "eagle"):
        try:
            equivalents[conv] = ids_for(conv, res.positions, L)
        except UsageError as e:
            equivalents[conv] = f"unreachable: {e}"
    if args.json:
        emit_json({**res.to_dict(), "equivalent_ids": equivalents})
        return 0
    ids = "default" if res.ids is None else ",".join(map(str, res.ids))
    print(f"{res.convention} ids {ids} on {L} layers -> {', '.join(map(str, res.positions))}")
    print(f"{res.internal_name}: {res.internal}")
    for n in res.notes:
        print(f"note: {n}")
    print("same positions in other conventions:")
    for conv, v in equivalents.items():
        print(f"  {conv:16} {v if isinstance(v, str) else ','.join(map(str, v))}")
    return 0
