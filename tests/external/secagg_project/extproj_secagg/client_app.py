"""ClientApp: local gradient steps on the received global state; Pollen's SecAgg+ mod masks the reply."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from pollen.protocol import encode_weights_reply
from pollen.secagg import secagg_mod

from extproj_secagg.task import local_train, partition

app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    pid = int(context.node_config["partition-id"])
    state = {k: a.numpy() for k, a in msg.content["arrays"].items()}
    x, y = partition(int(cfg["data-seed"]), pid, 0, int(cfg["num-features"]))
    new, loss = local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
    return Message(content=encode_weights_reply(new, len(y), {"partition-id": pid, "train-loss": loss}),
                   reply_to=msg)
