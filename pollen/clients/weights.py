"""Clients for parameter-averaging baselines: FedAvg / FedProx, and local-only training.

Each reads a :class:`~pollen.protocol.weights.WeightsInstruction` and answers with a
:class:`~pollen.protocol.weights.WeightsReply`: the model state by name. ``fit``/``evaluate`` are the
``NumPyClient`` boundary, where Flower's positional parameters become the named state and back.
"""

from __future__ import annotations

from pollen.clients.base import PollenClient
from pollen.methods.terms import CrossEntropy, LossTerm, Proximal, train_terms
from pollen.methods.training import evaluate_classifier, load_state, model_state, train_epochs
from pollen.protocol.records import Evaluation
from pollen.protocol.weights import WeightsInstruction, WeightsReply


class WeightClient(PollenClient):
    """Trains the received global model with CE (+ FedProx's proximal term when ``proximal-mu`` > 0)."""

    def get_parameters(self, config):
        return WeightsReply(model_state(self.new_model(init_seed=self.cfg.seed)), 0).parameters()

    def fit(self, parameters, config):
        reply = self.train(WeightsInstruction.from_parameters(self.state_keys(), parameters, config))
        return reply.parameters(), reply.num_examples, dict(reply.metrics)

    def evaluate(self, parameters, config):
        ins = WeightsInstruction.from_parameters(self.state_keys(), parameters, config)
        return self.numpy_evaluation(self.test(ins))

    def received_model(self, ins: WeightsInstruction):
        model = self.new_model()
        load_state(model, ins.state, self.model_name)
        return model

    def train(self, ins: WeightsInstruction) -> WeightsReply:
        privacy, sample = self.payload_privacy(), self.sample_privacy()
        for private in (privacy, sample):
            if private is not None:
                private.check()  # out of budget: stop before training, saying so
        mu = ins.proximal_mu
        model = self.received_model(ins)
        generator = self.round_generator(ins.server_round)
        terms: list[LossTerm] = [CrossEntropy()] + ([Proximal(mu)] if mu > 0 else [])
        for term in terms:
            term.start(model)
        try:
            history, trained = train_terms(model, self.data.x_train, self.data.y_train, terms,
                                           self.local_training(), generator=generator, device=self.device,
                                           sample=sample)
        except FloatingPointError as exc:
            if privacy is None:
                raise
            raise FloatingPointError(
                f"{exc}, or the noise: under dp-mode = payload the global model is the average of noisy "
                "releases; lower dp-noise-multiplier (or raise dp-target-epsilon) or dp-clip, or sample more "
                "clients per round") from exc
        metrics = self.base_metrics()
        if sample is not None and trained is not None:  # DP-SGD: the model is private, n is not released
            return WeightsReply(model_state(model), 1, {**metrics, **sample.spend(trained)})
        if privacy is not None:
            released, dp_metrics = privacy.update(ins.state, model_state(model))
            return WeightsReply(released, 1, {**metrics, **dp_metrics})  # 1: the dataset size is not released
        if history:
            metrics["train-loss"] = history[-1].loss
        return WeightsReply(model_state(model), self.data.num_train, metrics)

    def test(self, ins: WeightsInstruction) -> Evaluation:
        loss, acc = evaluate_classifier(self.received_model(ins), self.data.x_test, self.data.y_test, self.device)
        return Evaluation(loss, len(self.data.y_test), {**self.base_metrics(), "accuracy": acc})


class LocalClient(PollenClient):
    """Local-only baseline: the client's own model lives in ``context.state`` and never leaves."""

    STATE_KEY = "local-model"

    def _load(self):
        model = self.new_model(init_seed=self.cfg.seed)
        self.state.load_module(self.STATE_KEY, model)
        return model

    def fit(self, parameters, config):
        reply = self.train(WeightsInstruction({}, dict(config)))
        return reply.parameters(), reply.num_examples, dict(reply.metrics)

    def evaluate(self, parameters, config):
        return self.numpy_evaluation(self.test(WeightsInstruction({}, dict(config))))

    def train(self, ins: WeightsInstruction) -> WeightsReply:
        model = self._load()
        training = self.local_training()
        history = train_epochs(model, self.data.x_train, self.data.y_train, epochs=training.epochs,
                               batch_size=training.batch_size, generator=self.round_generator(ins.server_round),
                               device=self.device, optimizer=training.sgd(model))
        self.state.save_module(self.STATE_KEY, model)
        metrics = self.base_metrics()
        if history:
            metrics["train-loss"] = history[-1].loss
        return WeightsReply({}, self.data.num_train, metrics)

    def test(self, ins: WeightsInstruction) -> Evaluation:
        loss, acc = evaluate_classifier(self._load(), self.data.x_test, self.data.y_test, self.device)
        return Evaluation(loss, len(self.data.y_test), {**self.base_metrics(), "accuracy": acc})
