"""
bench/_senteval.py: how SentEval scores a sentence encoder (Conneau & Kiela, 2018), written out plainly in torch, so
that a reader sees it and bench/probing.py can use it without SentEval. The encoder is frozen: its embeddings are
the features of a small model trained on each task's train split.

- probe(): a logistic regression (SentEval's MLP with nhid=0, tools/classifier.py): Adam (lr 1e-3), batches of 64,
  an "epoch" of 4 passes, early stopping on the validation accuracy (stop after 5 epochs that do not beat the best,
  counted over the whole fit, as SentEval counts them; at most 200), the best epoch's weights kept; the L2 penalty
  chosen on the validation split among 1e-5 ... 1e-2, then the model trained again with it and scored on test
  (tools/validation.py's SplitClassifier).
- cross_validated(): the same where a task has no test split: k-fold cross-validation, the penalty chosen by an inner
  k-fold on each outer training part (SentEval's InnerKFoldClassifier, for MR, CR, SUBJ, MPQA).
- relatedness(): SentEval's supervised STS-B and SICK-R (sick.py, tools/relatedness.py): a pair (u, v) becomes the
  features [|u - v|, u * v]; its gold score becomes a distribution over the integer scores 1..5 as Tai et al. (2015)
  encode it (3.6 -> 0.4 on 3 and 0.6 on 4); a linear layer and a softmax are fitted to it by mean squared error,
  50 passes at a time, stopped on the validation Pearson (3 rounds without a better one); the prediction is the
  expected score, and the result its Spearman x 100.

SentEval sets `size_average = False` on its losses after building them, which in the PyTorch it was written for
made each loss a sum over the batch, not a mean: so here (it matters beside the L2 penalty, which Adam adds to the
gradient). Its STS-B uses the SICK code, classes 1..5, unchanged: a gold score below 1 (STS-B's go down to 0) is
encoded with less than a whole unit of weight, and every prediction lies in [1, 5]; kept as SentEval has it.

    from senteval import probe, relatedness
    dev_accuracy, test_accuracy = probe((X_train, y_train), (X_dev, y_dev), (X_test, y_test), classes)
"""
import functools
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evaluate_sts import pearson, spearman  # noqa: E402 (tied gold scores share their mean rank)
from support.threads import cpu_threads  # noqa: E402

# One thread: steps this small spend more time keeping threads in step than computing (3x slower on 2 threads)
one_thread = functools.partial(cpu_threads, 1)

L2 = [10.0 ** t for t in range(-5, -1)]  # SentEval's penalties for its PyTorch classifier
SEED = 1111  # SentEval's default seed


class Softmax:
    """A linear layer and a softmax, trained by Adam with its gradients written out (no autograd: these models are
    small enough that autograd's own bookkeeping was 3/4 of a step's time). loss "cross_entropy": SentEval's
    classifier's, summed over the batch; "squared": its relatedness regressor's, (softmax - target)^2 summed."""

    def __init__(self, dim: int, classes: int, l2: float = 0.0, seed: int = SEED, loss: str = "cross_entropy"):
        generator, bound = torch.Generator().manual_seed(seed), 1 / np.sqrt(dim)  # nn.Linear's initialisation
        self.W = torch.empty(dim, classes).uniform_(-bound, bound, generator=generator)  # (dim, classes)
        self.b = torch.empty(classes).uniform_(-bound, bound, generator=generator)  # (classes,)
        self.l2, self.loss, self.t = l2, loss, 0
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in (self.W, self.b)]

    def probabilities(self, X: torch.Tensor) -> torch.Tensor:
        return torch.softmax(X @ self.W + self.b, dim=1)  # (n, classes)

    def gradients(self, X: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dL/dW, dL/db) of the summed loss over a batch; target: one-hot rows, or the Tai distributions."""
        p = self.probabilities(X)
        if self.loss == "cross_entropy":
            dz = p - target  # d/dz of -log softmax(z)[y]
        else:
            g = 2 * (p - target)  # d/dp of the squared error, then through the softmax's Jacobian
            dz = p * (g - (g * p).sum(1, keepdim=True))
        return X.T @ dz, dz.sum(0)

    def step(self, X: torch.Tensor, target: torch.Tensor, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        """One step of torch.optim.Adam as SentEval builds it (lr 1e-3, weight_decay = the L2 penalty, added to the
        gradient), written out."""
        self.t += 1
        for p, grad, (m, v) in zip((self.W, self.b), self.gradients(X, target), self.moments, strict=True):
            grad = grad + self.l2 * p
            m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
            v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
            denominator = (v / (1 - betas[1] ** self.t)).sqrt_().add_(eps)
            p.addcdiv_(m, denominator, value=-lr / (1 - betas[0] ** self.t))

    def state(self):
        return self.W.clone(), self.b.clone()

    def load(self, state):
        self.W, self.b = (x.clone() for x in state)


class LogisticRegression:
    """SentEval's PyTorchClassifier with nhid=0: a linear layer trained with cross-entropy summed over each batch."""

    def __init__(self, dim: int, classes: int, l2: float, seed: int = SEED, batch: int = 64, epoch_size: int = 4,
                 tenacity: int = 5, max_epochs: int = 200):
        self.rng, self.model, self.classes = np.random.default_rng(seed), Softmax(dim, classes, l2, seed), classes
        self.batch, self.epoch_size, self.tenacity, self.max_epochs = batch, epoch_size, tenacity, max_epochs

    def fit(self, X: torch.Tensor, y: torch.Tensor, X_dev: torch.Tensor, y_dev: torch.Tensor) -> float:
        """Train until the validation accuracy has not improved `tenacity` times; keep the best; its accuracy."""
        best, best_state, misses, epochs = -1.0, None, 0, 0
        Y = torch.nn.functional.one_hot(y, self.classes).float()
        while epochs <= self.max_epochs:
            # One SentEval "epoch": epoch_size shuffled passes over the training set, in batches
            for _ in range(self.epoch_size):
                order = torch.from_numpy(self.rng.permutation(len(X)))
                X_order, Y_order = X[order], Y[order]
                for i in range(0, len(X), self.batch):
                    self.model.step(X_order[i:i + self.batch], Y_order[i:i + self.batch])
            epochs += self.epoch_size
            # Early stopping on the validation accuracy: the best weights are kept
            accuracy = self.score(X_dev, y_dev)
            if accuracy > best:
                best, best_state = accuracy, self.model.state()
            else:
                if misses >= self.tenacity:
                    break
                misses += 1
        self.model.load(best_state)
        return best

    def score(self, X: torch.Tensor, y: torch.Tensor) -> float:
        return (self.model.probabilities(X).argmax(1) == y).float().mean().item()


def tensors(X, y=None):
    X = torch.as_tensor(np.asarray(X), dtype=torch.float32)
    return X if y is None else (X, torch.as_tensor(np.asarray(y), dtype=torch.int64))


@one_thread()
def probe(train, dev, test, classes: int, seed: int = SEED) -> tuple[float, float]:
    """(validation accuracy x 100 at the chosen penalty, test accuracy x 100): SentEval's SplitClassifier."""
    (X, y), (X_dev, y_dev), (X_test, y_test) = tensors(*train), tensors(*dev), tensors(*test)
    # The penalty: the one whose model scores best on the validation split (SentEval rounds to 2 decimals)
    scores = [round(100 * LogisticRegression(X.shape[1], classes, l2, seed).fit(X, y, X_dev, y_dev), 2) for l2 in L2]
    l2 = L2[int(np.argmax(scores))]
    # Trained again with it, early-stopped on the same validation split, then scored on test
    clf = LogisticRegression(X.shape[1], classes, l2, seed)
    clf.fit(X, y, X_dev, y_dev)
    return max(scores), round(100 * clf.score(X_test, y_test), 2)


@one_thread()
def probe_without_stopping(train, dev, test, classes: int, passes: int = 1000, seed: int = SEED) -> float:
    """Test accuracy x 100 of the same logistic regression at SentEval's smallest penalty, trained for `passes`
    passes with no early stopping (the best validation epoch's weights kept): what SentEval's stopping rule and
    200-pass limit leave out, where a probe needs large weights (bench/probing.py's check against scikit-learn)."""
    (X, y), (X_dev, y_dev), (X_test, y_test) = tensors(*train), tensors(*dev), tensors(*test)
    clf = LogisticRegression(X.shape[1], classes, L2[0], seed, tenacity=passes, max_epochs=passes)
    clf.fit(X, y, X_dev, y_dev)
    return round(100 * clf.score(X_test, y_test), 2)


def stratified_folds(y: np.ndarray, k: int, seed: int) -> list[np.ndarray]:
    """k folds of indices, each class shuffled and dealt round the folds in turn (StratifiedKFold's aim)."""
    rng, folds = np.random.default_rng(seed), [[] for _ in range(k)]
    start = 0
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        for i, index in enumerate(members):
            folds[(start + i) % k].append(index)
        start += len(members)  # the next class is dealt on from where this one stopped: folds of even size
    return [np.sort(np.array(f, dtype=np.int64)) for f in folds]


def split_off(X: np.ndarray, y: np.ndarray, share: float, seed: int):
    """(train, validation): a random share held out to early-stop on (SentEval's validation_split)."""
    order = np.random.default_rng(seed).permutation(len(X))
    cut = int(share * len(X))
    return (X[order[cut:]], y[order[cut:]]), (X[order[:cut]], y[order[:cut]])


@one_thread()
def cross_validated(X, y, classes: int, k: int = 5, seed: int = SEED) -> tuple[float, float]:
    """(inner validation accuracy, test accuracy) x 100, each the mean over k outer folds: SentEval's
    InnerKFoldClassifier, for a task that has no test split."""
    X, y = np.asarray(X, dtype=np.float32), np.asarray(y)
    dev_scores, test_scores = [], []
    outer = stratified_folds(y, k, seed)
    for fold in outer:
        train = np.setdiff1d(np.arange(len(y)), fold)
        X_train, y_train = X[train], y[train]
        inner = stratified_folds(y_train, k, seed)
        # The penalty: the best mean accuracy over an inner k-fold of this outer fold's training part
        means = []
        for l2 in L2:
            accuracies = []
            for held in inner:
                rest = np.setdiff1d(np.arange(len(y_train)), held)
                clf = LogisticRegression(X.shape[1], classes, l2, seed)
                accuracies.append(clf.fit(*tensors(X_train[rest], y_train[rest]),
                                          *tensors(X_train[held], y_train[held])))
            means.append(round(100 * float(np.mean(accuracies)), 2))
        dev_scores.append(max(means))
        # Trained on the whole training part (5% of it held out to stop on), scored on the outer fold
        part, stop_on = split_off(X_train, y_train, 0.05, seed)
        clf = LogisticRegression(X.shape[1], classes, L2[int(np.argmax(means))], seed)
        clf.fit(*tensors(*part), *tensors(*stop_on))
        test_scores.append(round(100 * clf.score(*tensors(X[fold], y[fold])), 2))
    return round(float(np.mean(dev_scores)), 2), round(float(np.mean(test_scores)), 2)


# -----------------------------------------------------------------------------------------------
# Supervised relatedness: STS-B and SICK-R as SentEval scores them


def pair_features(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """[|u - v|, u * v]: what SentEval's relatedness regressor sees of a pair (sick.py)."""
    return np.concatenate([np.abs(u - v), u * v], axis=1)


def tai_targets(scores, classes: int = 5) -> np.ndarray:
    """Tai et al. (2015)'s encoding, SentEval's encode_labels: a score y between the integers floor(y) and floor(y)
    + 1 (classes 1..5) puts y - floor(y) on the upper one and floor(y) - y + 1 on the lower one."""
    out = np.zeros((len(scores), classes), dtype=np.float32)
    for j, y in enumerate(scores):
        low = int(np.floor(y))
        if 1 <= low + 1 <= classes:
            out[j, low] = y - low  # class low + 1, at index low
        if 1 <= low <= classes:
            out[j, low - 1] = low - y + 1  # class low
    return out


@one_thread()
def relatedness(train, dev, test, seed: int = SEED, classes: int = 5) -> dict:
    """train, dev, test: (u, v, gold) each, u and v the two sentences' embeddings. {"dev_pearson", "pearson",
    "spearman"} on test, x 100: SentEval's RelatednessPytorch."""
    (X, Y), (X_dev, gold_dev), (X_test, gold_test) = [
        (torch.as_tensor(pair_features(u, v), dtype=torch.float32), gold) for u, v, gold in (train, dev, test)]
    Y = torch.as_tensor(tai_targets(Y, classes))
    rng, model = np.random.default_rng(seed), Softmax(X.shape[1], classes, seed=seed, loss="squared")
    r = torch.arange(1, classes + 1, dtype=torch.float32)

    def predict(features):  # the expected score under the predicted distribution
        return (model.probabilities(features) @ r).numpy()

    best, best_state, misses, epochs = -1.0, None, 0, 0
    while epochs <= 1000:
        # 50 shuffled passes, then the validation Pearson decides whether to go on
        for _ in range(50):
            order = torch.from_numpy(rng.permutation(len(X)))
            X_order, Y_order = X[order], Y[order]
            for i in range(0, len(X), 64):
                model.step(X_order[i:i + 64], Y_order[i:i + 64])
        epochs += 50
        correlation = float(np.nan_to_num(pearson(predict(X_dev), gold_dev)))  # nan (a constant prediction): 0
        if correlation > best:
            best, best_state = correlation, model.state()
        else:
            if misses >= 3:
                break
            misses += 1
    model.load(best_state)
    prediction = predict(X_test)
    return {"dev_pearson": 100 * best, "pearson": 100 * pearson(prediction, gold_test),
            "spearman": 100 * spearman(prediction, gold_test)}

