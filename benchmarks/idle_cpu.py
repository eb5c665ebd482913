"""What a running app costs when nothing happens: CPU by process role over idle windows (issue 37's
criterion: the embedded default, healthy and idle, under 10 % of one core across the app's replicas
and engines; heartbeats, polls and ticks are all that run).

    python -m benchmarks.idle_cpu [--app default] [--seconds 30] [--windows 3]

Start the app as the README does (`serve run` names its application `default`), send a few turns,
let it settle a minute, then run this on the same machine.
"""

import argparse
import time

from benchmarks.cpu_profile import APP_ROLES, roles_of, snapshot, spent_since


def window(roles: tuple[tuple[str, str], ...], seconds: float) -> dict[str, float]:
    """Each role's CPU over `seconds`, in % of one core."""
    before = snapshot(roles)
    time.sleep(seconds)
    return {role: round(100 * used / seconds, 2) for role, used in spent_since(before, roles).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--app", default="default", help="the Serve application's name")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--windows", type=int, default=3)
    args = parser.parse_args()
    roles = roles_of(args.app)
    for n in range(1, args.windows + 1):
        used = window(roles, args.seconds)
        ours = {role: share for role, share in used.items() if _of_the_app(role)}
        rest = ", ".join(f"{role} {share}" for role, share in used.items() if role not in ours)
        print(f"window {n}: replicas + engines {round(sum(ours.values()), 2)} % of a core "
              f"({', '.join(f'{r} {s}' for r, s in ours.items())}); others: {rest}")


def _of_the_app(role: str) -> bool:
    """A replica of the app, or an engine process one of them started ("engine core (decode replica)")."""
    return role in APP_ROLES or role.removeprefix("engine core (").removesuffix(")") in APP_ROLES


if __name__ == "__main__":
    main()
