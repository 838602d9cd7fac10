"""The CloudFormation template, loaded with cfn-lint's own YAML decoder and resolved for given
parameters, so tests read the values a deployed stack would have rather than the raw tags.

Physical ids the tests cannot know (a role's or a task definition's ARN) resolve to stand-ins of the
right shape, built from the logical id."""

from __future__ import annotations

import re
from typing import Any

from cfnlint.decode import cfn_yaml

from tests.deploy.files import REPO

TEMPLATE_PATH = REPO / "config" / "cloudformation.yaml"
REGION, ACCOUNT = "eu-west-1", "123456789012"
MODEL_BUCKET = "stack-modelbucket-1a2b3c"
_NO_VALUE = object()


def load_template() -> dict:
    return cfn_yaml.loads(TEMPLATE_PATH.read_text(), str(TEMPLATE_PATH))


class Resolver:
    """Evaluates Ref, Fn::GetAtt, Fn::Sub, Fn::If, Fn::Not, Fn::And, Fn::Equals, Fn::Select, Fn::Split
    and Condition for one set of parameters."""

    def __init__(self, template: dict, **params: str) -> None:
        self.template = template
        self.params = {
            name: str(params.get(name, spec.get("Default", "")))
            for name, spec in template["Parameters"].items()
        }
        unknown = set(params) - set(self.params)
        if unknown:
            raise KeyError(f"not template parameters: {sorted(unknown)}")
        self.params.update(
            {"AWS::Partition": "aws", "AWS::Region": REGION, "AWS::AccountId": ACCOUNT,
             "AWS::URLSuffix": "amazonaws.com"}
        )
        self.lists = {name for name, spec in template["Parameters"].items()
                      if spec["Type"] == "CommaDelimitedList"}

    def resolve(self, node: Any) -> Any:
        if isinstance(node, dict):
            if len(node) == 1:
                (key, arg), = node.items()
                if key in ("Ref", "Condition") or key.startswith("Fn::"):
                    return self._intrinsic(key, arg)
            out = {k: self.resolve(v) for k, v in node.items()}
            return {k: v for k, v in out.items() if v is not _NO_VALUE}
        if isinstance(node, list):
            return [v for v in (self.resolve(item) for item in node) if v is not _NO_VALUE]
        return node

    def condition(self, name: str) -> bool:
        return bool(self.resolve(self.template["Conditions"][name]))

    def resource(self, logical_id: str) -> dict:
        return self.resolve(self.template["Resources"][logical_id].get("Properties", {}))

    def exists(self, logical_id: str) -> bool:
        """Whether the stack creates the resource: it has no Condition, or its Condition holds."""
        condition = self.template["Resources"][logical_id].get("Condition")
        return condition is None or self.condition(condition)

    def _intrinsic(self, key: str, arg: Any) -> Any:
        if key == "Ref":
            return _NO_VALUE if arg == "AWS::NoValue" else self._ref(arg)
        if key == "Fn::GetAtt":
            logical_id, attr = arg if isinstance(arg, list) else arg.split(".", 1)
            return self._attribute(logical_id, attr)
        if key == "Fn::Sub":
            return self._sub(arg)
        if key == "Fn::If":
            name, when_true, when_false = arg
            return self.resolve(when_true if self.condition(name) else when_false)
        if key == "Fn::Not":
            return not self.resolve(arg[0])
        if key == "Fn::And":
            return all(self.resolve(item) for item in arg)
        if key == "Condition":
            return self.condition(arg)
        if key == "Fn::Select":
            index, items = arg
            return self.resolve(items)[int(self.resolve(index))]
        if key == "Fn::Split":
            separator, text = arg
            return str(self.resolve(text)).split(separator)
        if key == "Fn::Equals":
            left, right = (self.resolve(a) for a in arg)
            return str(left) == str(right)
        if key == "Fn::Base64":  # kept as text, so tests read the user data
            return self.resolve(arg)
        raise NotImplementedError(f"intrinsic {key} is not resolved by these tests")

    def _ref(self, name: str) -> Any:
        if name in self.lists:
            return self.params[name].split(",")
        if name in self.params:
            return self.params[name]
        spec = self.template["Resources"][name]
        kind = spec["Type"]
        if kind == "AWS::ECS::Cluster":
            return self.resolve(spec["Properties"]["ClusterName"])
        if kind == "AWS::Logs::LogGroup":
            return self.resolve(spec["Properties"]["LogGroupName"])
        if kind == "AWS::ECS::TaskDefinition":
            family = self.resolve(spec["Properties"]["Family"])
            return f"arn:aws:ecs:{REGION}:{ACCOUNT}:task-definition/{family}:1"
        if kind == "AWS::ApplicationAutoScaling::ScalingPolicy":
            return f"arn:aws:autoscaling:{REGION}:{ACCOUNT}:scalingPolicy:uuid:resource/ecs/policyName/{name}"
        if kind in ("AWS::IAM::Role", "AWS::IAM::InstanceProfile", "AWS::ECS::CapacityProvider",
                    "AWS::AutoScaling::AutoScalingGroup", "AWS::EC2::LaunchTemplate",
                    "AWS::ApplicationAutoScaling::ScalableTarget"):
            return f"stack-{name}-ABC123"
        if kind == "AWS::SQS::Queue":
            return f"https://sqs.{REGION}.amazonaws.com/{ACCOUNT}/{self._queue_name(name)}"
        if kind == "AWS::S3::Bucket":
            return MODEL_BUCKET
        if kind == "AWS::IAM::ManagedPolicy":
            return f"arn:aws:iam::{ACCOUNT}:policy/{name}"
        raise NotImplementedError(f"Ref to a {kind}")

    def _attribute(self, logical_id: str, attr: str) -> str:
        kind = self.template["Resources"][logical_id]["Type"]
        if kind == "AWS::SQS::Queue" and attr == "Arn":
            return f"arn:aws:sqs:{REGION}:{ACCOUNT}:{self._queue_name(logical_id)}"
        if kind == "AWS::SQS::Queue" and attr == "QueueName":
            return self._queue_name(logical_id)
        if kind == "AWS::S3::Bucket" and attr == "Arn":
            return f"arn:aws:s3:::{MODEL_BUCKET}"
        if kind == "AWS::IAM::Role" and attr == "Arn":
            return f"arn:aws:iam::{ACCOUNT}:role/{self._ref(logical_id)}"
        if kind == "AWS::IAM::InstanceProfile" and attr == "Arn":
            return f"arn:aws:iam::{ACCOUNT}:instance-profile/{self._ref(logical_id)}"
        if kind == "AWS::ECS::Cluster" and attr == "Arn":
            return f"arn:aws:ecs:{REGION}:{ACCOUNT}:cluster/{self._ref(logical_id)}"
        if kind == "AWS::Logs::LogGroup" and attr == "Arn":
            return f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{self._ref(logical_id)}:*"
        if kind == "AWS::ECS::Service" and attr == "Name":
            return self.resolve(self.template["Resources"][logical_id]["Properties"]["ServiceName"])
        if kind == "AWS::EC2::LaunchTemplate" and attr == "LatestVersionNumber":
            return "1"
        raise NotImplementedError(f"GetAtt {logical_id}.{attr}")

    def _queue_name(self, logical_id: str) -> str:
        return self.resolve(self.template["Resources"][logical_id]["Properties"]["QueueName"])

    def _sub(self, arg: Any) -> str:
        text, variables = (arg, {}) if isinstance(arg, str) else (arg[0], arg[1])

        def replace(match: re.Match) -> str:
            name = match.group(1)
            if name in variables:
                return str(self.resolve(variables[name]))
            if name in self.params:
                return self.params[name]
            if "." in name:
                return self._attribute(*name.split(".", 1))
            return self._ref(name)

        return re.sub(r"\$\{([^}!]+)\}", replace, text)
