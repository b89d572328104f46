"""wordle: find a secret five-letter word in a few guesses, with feedback after each one.

A multi-turn game. The environment scores every guess with one mark per letter — `G` right letter in the
right place, `Y` in the word elsewhere, `.` not in the word (as Wordle does for repeated letters: each
secret letter is matched once, places first) — and sends the marks back as the next user message. The
game ends when the word is found or after `max_guesses` guesses; a reply that is not a five-letter word
is told so and uses up a guess. Secrets are drawn from a word list shipped here (or its first `num_words`
words: fewer words, an easier game), seeded. Each example's `demonstration` (for SFT) is a game played by
guessing words of the list that agree with all the marks so far. Rewards:
- `solved` (weight 1): the secret was guessed;
- `speed` (weight `speed_weight`, 0.5): if solved, (max_guesses − guesses) / (max_guesses − 1), so 1 for a
  first-guess win and 0 for a win on the last guess.
Metrics: `guesses`, `invalid_guesses` and `best_greens` (the most `G` marks in one guess, of 5).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

from asyncrl.environments.base import Environment, Example, Messages, State
from asyncrl.environments.rubric import Rubric

WORDS = (
    "about above actor adult after again agent alarm album alert alike alive allow alone along angle angry "
    "apple apply arena argue arise armed aside asset audio award aware badge basic beach begin being below "
    "bench birth black blade blame blind block blood board boost brain brand bread break brick brief bring "
    "broad brown build buyer cabin cable candy carry catch cause chain chair chart chase cheap check chest "
    "chief child civil claim class clean clear climb clock close cloud coach coast count court cover craft "
    "crash cream crime cross crowd crown curve cycle daily dance death delay depth dirty doubt dozen draft "
    "drama dream dress drink drive early earth eight elite empty enemy enjoy enter entry equal error event "
    "exact exist extra faith false fault field fifty fight final first flame fleet floor focus force frame "
    "fresh front fruit funny giant given glass globe grace grade grain grand grant grass great green group "
    "guard guess guide happy heart heavy horse hotel house human ideal image index inner input issue joint "
    "judge juice knife label large laser later laugh layer learn least leave legal lemon level light limit "
    "local logic loose lucky lunch magic major maker march match metal minor model money month moral motor "
    "mouse mouth music nerve never night noise north novel nurse ocean offer often order other owner paint "
    "panel paper party peace phase phone photo piano piece pilot pitch place plain plane plant plate point "
    "pound power press price pride prime print prize proof proud queen quick quiet quite radio raise range "
    "rapid ratio reach ready river robot rough round route royal rural scale scene scope score sense serve "
    "seven shape share sharp sheep shelf shell shift shirt shock shoot short sight skill sleep slide small "
    "smart smile smoke solid solve sound south space spare speak speed spend spite split sport staff stage "
    "stand start state steam steel stick still stock stone store storm story strip study style sugar sunny "
    "super sweet table taste teach thank theme thick thing think third throw tight title today topic total "
    "touch tough tower track trade train treat trend trial truck trust truth twice uncle under union unity "
    "upper urban usage usual valid value video visit vital voice waste watch water wheel where while white "
    "whole woman world worry write wrong young youth"
).split()

PROMPT = (
    "Guess my secret five-letter word in at most {max_guesses} guesses. Reply with one lowercase word. "
    "I answer with a mark per letter: G right place, Y elsewhere in the word, . not in the word."
)


def marks(guess: str, secret: str) -> str:
    """Wordle's feedback for one guess."""
    result = ["G" if g == s else "." for g, s in zip(guess, secret)]
    unmatched = Counter(s for g, s in zip(guess, secret) if g != s)
    for i, g in enumerate(guess):
        if result[i] == "." and unmatched[g] > 0:
            result[i] = "Y"
            unmatched[g] -= 1
    return "".join(result)


class Wordle(Environment):
    name = "wordle"

    def __init__(self, max_guesses: int = 6, speed_weight: float = 0.5, num_words: int | None = None, **limits):
        super().__init__(**{"max_turns": max_guesses, **limits})
        if max_guesses < 2:
            raise ValueError(f"max_guesses must be at least 2, got {max_guesses}")
        if num_words is not None and not 2 <= num_words <= len(WORDS):
            raise ValueError(f"num_words must be between 2 and {len(WORDS)}, got {num_words}")
        self.max_guesses = max_guesses
        self.words = WORDS[:num_words]
        self.rubric = Rubric(
            rewards=[(solved, 1.0), (speed, speed_weight)], metrics=[guesses, invalid_guesses, best_greens]
        )

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)
        demonstrations = random.Random(f"demonstrations {seed}")  # a stream of its own: secrets stay as they were
        prompt = PROMPT.format(max_guesses=self.max_guesses)
        while True:
            secret = rng.choice(self.words)
            yield Example(
                prompt=[{"role": "user", "content": prompt}],
                answer=secret,
                info={"secret": secret, "max_guesses": self.max_guesses},
                demonstration=self.demonstration(secret, demonstrations),
            )

    def demonstration(self, secret: str, rng: random.Random) -> Messages:
        """A game played by guessing, each time, a word of the list that agrees with every mark so far."""
        candidates, messages = self.words, []
        for guessed in range(1, self.max_guesses + 1):
            guess = rng.choice(candidates)
            feedback = marks(guess, secret)
            messages.append({"role": "assistant", "content": guess})
            if feedback == "GGGGG" or guessed == self.max_guesses:
                break
            messages.append({"role": "user", "content": reply(feedback, self.max_guesses - guessed)})
            candidates = [word for word in candidates if marks(guess, word) == feedback]
        return messages

    async def respond(self, messages: Messages, state: State, example: Example) -> Messages | None:
        guess = messages[-1]["content"].strip().lower()
        state.setdefault("feedback", [])
        state.setdefault("invalid", 0)
        if len(guess) == 5 and guess.isascii() and guess.isalpha():
            feedback = marks(guess, example.info["secret"])
        else:
            feedback = "not a five-letter word"
            state["invalid"] += 1
        state["feedback"].append(feedback)
        state["solved"] = feedback == "GGGGG"
        left = self.max_guesses - len(state["feedback"])
        if state["solved"] or left == 0:
            return None
        return [{"role": "user", "content": reply(feedback, left)}]


def reply(feedback: str, left: int) -> str:
    return f"{feedback} ({left} left)"


def solved(completion: str, example: Example, state: State) -> float:
    return float(state.get("solved", False))


def speed(completion: str, example: Example, state: State) -> float:
    if not state.get("solved"):
        return 0.0
    limit = example.info["max_guesses"]
    return (limit - len(state["feedback"])) / (limit - 1)


def guesses(completion: str, example: Example, state: State) -> float:
    return len(state.get("feedback", []))


def invalid_guesses(completion: str, example: Example, state: State) -> float:
    return state.get("invalid", 0)


def best_greens(completion: str, example: Example, state: State) -> float:
    return max((f.count("G") for f in state.get("feedback", [])), default=0) / 5
