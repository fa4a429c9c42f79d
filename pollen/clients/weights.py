"""Clients for parameter-averaging baselines: FedAvg / FedProx, and local-only training."""

from __future__ import annotations

from pollen.clients.base import PollenClient
from pollen.methods.terms import CrossEntropy, LossTerm, Proximal, train_terms
from pollen.methods.training import evaluate_classifier, load_model_arrays, model_arrays, train_epochs


class WeightClient(PollenClient):
    """Trains the received global model with CE (+ FedProx's proximal term when ``proximal-mu`` > 0)."""

    def get_parameters(self, config):
        return model_arrays(self.new_model(init_seed=self.cfg.seed))

    def fit(self, parameters, config):
        server_round = int(config.get("server-round", 0))
        privacy, sample = self.payload_privacy(), self.sample_privacy()
        for private in (privacy, sample):
            if private is not None:
                private.check()  # out of budget: stop before training, saying so
        mu = float(config.get("proximal-mu", 0.0))
        model = self.new_model()
        load_model_arrays(model, parameters)
        generator = self.round_generator(server_round)
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
            return model_arrays(model), 1, {**metrics, **sample.spend(trained)}
        if privacy is not None:
            reply, dp_metrics = privacy.update(list(parameters), model_arrays(model))
            return reply, 1, {**metrics, **dp_metrics}  # 1: the dataset size is not released (uniform weights)
        if history:
            metrics["train-loss"] = history[-1].loss
        return model_arrays(model), self.data.num_train, metrics

    def evaluate(self, parameters, config):
        model = self.new_model()
        load_model_arrays(model, parameters)
        loss, acc = evaluate_classifier(model, self.data.x_test, self.data.y_test, self.device)
        return loss, len(self.data.y_test), {**self.base_metrics(), "accuracy": acc}


class LocalClient(PollenClient):
    """Local-only baseline: the client's own model lives in ``context.state`` and never leaves."""

    STATE_KEY = "local-model"

    def _load(self):
        model = self.new_model(init_seed=self.cfg.seed)
        self.state.load_module(self.STATE_KEY, model)
        return model

    def fit(self, parameters, config):
        server_round = int(config.get("server-round", 0))
        model = self._load()
        training = self.local_training()
        history = train_epochs(model, self.data.x_train, self.data.y_train, epochs=training.epochs,
                               batch_size=training.batch_size, generator=self.round_generator(server_round),
                               device=self.device, optimizer=training.sgd(model))
        self.state.save_module(self.STATE_KEY, model)
        metrics = self.base_metrics()
        if history:
            metrics["train-loss"] = history[-1].loss
        return [], self.data.num_train, metrics

    def evaluate(self, parameters, config):
        loss, acc = evaluate_classifier(self._load(), self.data.x_test, self.data.y_test, self.device)
        return loss, len(self.data.y_test), {**self.base_metrics(), "accuracy": acc}
