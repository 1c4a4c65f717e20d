"""asyncquickstartdp: the quickstart's plain Flower ClientApp plus Flower's own
fixedclipping_mod, which clips each update to the norm the server sends (it knows nothing
of fedstale). The mod is on the train handler only: only train messages carry the norm,
and on the whole ClientApp it would fail every evaluate message."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from asyncquickstartdp.task import Net, load_data
from asyncquickstartdp.task import test as test_fn
from asyncquickstartdp.task import train as train_fn

app = ClientApp()
device = "cuda" if torch.cuda.is_available() else "cpu"


@app.train(mods=[fixedclipping_mod])
def train(msg: Message, context: Context) -> Message:
    """Train the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = load_data(
        context.node_config["partition-id"],
        context.node_config["num-partitions"],
        context.run_config["batch-size"],
    )
    train_loss = train_fn(
        model,
        trainloader,
        context.run_config["local-epochs"],
        msg.content["config"]["lr"],
        device,
    )
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, valloader = load_data(
        context.node_config["partition-id"],
        context.node_config["num-partitions"],
        context.run_config["batch-size"],
    )
    eval_loss, eval_acc = test_fn(model, valloader, device)
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)}
    content = RecordDict({"metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
