"""A learned ranker of output lengths (for `--policy ltr`), after Fu et al., "Efficient LLM Scheduling by
Learning to Rank" (NeurIPS 2024): what a scheduler needs is the order of the requests' output lengths,
not the lengths, so the model is trained on the order, with the listwise ListMLE loss, and judged by
Kendall's tau between its scores and the true lengths.

The paper fine-tunes OPT-125m on the prompt. Here the prompt's all-MiniLM-L6-v2 sentence embedding (the
embedding model the length predictors use, frozen) and its log length feed a small MLP scorer, trained
with ListMLE on random lists of training pairs. `predict` maps a score onto a length by the training
lengths' quantiles (monotone, so the order is the ranker's), so that the policies that read a predicted
length (ltr, spf, hrrn, reservations) take it as it is.

Held-out pairs are chosen by a digest of the prompt's text (`held_out`), not by position, so the same
pairs are held out whichever tokenizer filtered the file: the arena's ShareGPT workload draws from them.
"""
from __future__ import annotations

import hashlib

import numpy as np

HELD_OUT_SHARE = 5  # one pair in five held out


def held_out(text: str) -> bool:
    """Whether a ShareGPT prompt belongs to the held-out pairs (by its text's digest: one in five)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") % HELD_OUT_SHARE == 0


def kendall_tau(scores, lengths) -> float:
    """Kendall's tau-b between scores and true lengths (ties in either count as neither)."""
    from scipy.stats import kendalltau

    return float(kendalltau(np.asarray(scores, float), np.asarray(lengths, float)).statistic)


def list_tau(scores, lengths, size: int = 64, lists: int = 200, seed: int = 0) -> float:
    """Mean Kendall's tau over random lists of `size` requests: how well a batch a scheduler sees at once
    is ordered (the whole set's tau gives the same figure in expectation, with less spread)."""
    rng = np.random.default_rng(seed)
    s, y = np.asarray(scores, float), np.asarray(lengths, float)
    size = min(size, len(y))
    return float(np.mean([kendall_tau(s[j], y[j]) for j in (rng.choice(len(y), size, replace=False)
                                                               for _ in range(lists))]))


def rows(embeddings, prompt_lengths) -> np.ndarray:
    """The ranker's input rows: each prompt's sentence embedding, then its length (WordPiece tokens)."""
    return np.hstack([np.asarray(embeddings, float), np.asarray(prompt_lengths, float)[:, None]])


def list_mle(scores, lengths):
    """ListMLE (Xia et al., 2008): the negative log-likelihood of the true order (longest first) under the
    Plackett-Luce model of the scores; rows are lists. Ties are broken at random."""
    import torch

    order = torch.argsort(lengths + 1e-3 * torch.rand_like(lengths), dim=-1, descending=True)
    s = torch.gather(scores, -1, order)
    return (torch.logcumsumexp(s.flip(-1), -1).flip(-1) - s).sum(-1).mean()


class LengthRanker:
    """fit(X, y) on `rows` (embedding, prompt length) and output lengths; score(X): higher = longer;
    predict(X): the score as a length (the training lengths' quantile at the score's rank)."""

    name = "ranker"

    def __init__(self, hidden: int = 128, list_size: int = 64, lists_per_step: int = 16, steps: int = 1500,
                 lr: float = 1e-3, weight_decay: float = 1e-4, seed: int = 0):
        self.hidden, self.list_size, self.lists_per_step, self.steps = hidden, list_size, lists_per_step, steps
        self.lr, self.weight_decay, self.seed = lr, weight_decay, seed

    @staticmethod
    def _logged(X) -> np.ndarray:
        X = np.asarray(X, np.float32).copy()
        X[:, -1] = np.log1p(X[:, -1])  # the prompt length, logged
        return X

    def _inputs(self, X):
        import torch

        return torch.from_numpy((self._logged(X) - self.mu) / self.sd)

    def fit(self, X, y):
        import torch

        X, y = np.asarray(X, np.float32), np.asarray(y, float)
        if len(y) < 2:
            raise ValueError("the ranker needs at least two training pairs")
        logged = self._logged(X)
        self.mu, self.sd = logged.mean(0), logged.std(0) + 1e-6
        with torch.random.fork_rng(devices=[]):  # seeded here, the caller's random stream left as it was
            self._train(X, y, torch)
        self.net.eval()
        self.lengths = np.sort(y)  # scores -> lengths by rank
        self.train_scores = np.sort(self.score(X))
        return self

    def _train(self, X, y, torch) -> None:
        g = torch.Generator().manual_seed(self.seed)
        torch.manual_seed(self.seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(X.shape[1], self.hidden), torch.nn.GELU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(self.hidden, 1))
        opt = torch.optim.AdamW(self.net.parameters(), self.lr, weight_decay=self.weight_decay)
        xs, ys = self._inputs(X), torch.tensor(np.log1p(y), dtype=torch.float32)
        size = min(self.list_size, len(y))
        self.net.train()
        for _ in range(self.steps):
            rows = torch.rand(self.lists_per_step, len(y), generator=g).argsort(dim=1)[:, :size]
            loss = list_mle(self.net(xs[rows]).squeeze(-1), ys[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()

    def score(self, X) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.net(self._inputs(X)).squeeze(-1).numpy().astype(float)

    def predict(self, X) -> np.ndarray:
        q = np.searchsorted(self.train_scores, self.score(X)) / len(self.train_scores)
        return self.lengths[np.minimum((q * len(self.lengths)).astype(int), len(self.lengths) - 1)]

    def __repr__(self) -> str:
        return f"LengthRanker(hidden={self.hidden}, steps={self.steps}, lists of {self.list_size})"
