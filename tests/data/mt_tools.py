"""Tools for the multi-turn tests: well-behaved ones and ones that misbehave in each way a tool can."""

import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def echo(text: str, secret: str = "") -> str:
    """Repeat a text back.

    Args:
        text: What to repeat.
        secret: Bound by the data row (extra_info.tools_kwargs), never by the model.
    """
    return text + secret


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def broken(x: int) -> str:
    """Raise an exception.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken tool got {x}")


def killer(x: int) -> str:
    """Kill its own process.

    Args:
        x: Anything.
    """
    os._exit(9)


TOOLS = [add, echo, sleepy, broken, killer]


class Vault:
    """An environment: each episode's vault opens with the row's ground truth; the score is whether it opened."""

    def reset(self, ground_truth=None, **row):
        if ground_truth == "badreset":
            raise RuntimeError("this vault cannot be set up")
        self.secret, self.attempts, self.opened = str(ground_truth), 0, False

    def open_vault(self, code: str) -> str:
        """Try a code on the vault.

        Args:
            code: The code to try.
        """
        self.attempts += 1
        self.opened = self.opened or code == self.secret
        return f"{'open' if code == self.secret else 'wrong code'} (attempt {self.attempts})"

    def crash(self, x: int) -> str:
        """Kill the process the environment lives in.

        Args:
            x: Anything.
        """
        os._exit(9)

    def reward(self):
        if self.secret == "raise":
            raise ValueError("no reward for this vault")
        return {"score": float(self.opened), "attempts": self.attempts}

    def close(self):
        pass
