# Kestrel: the commands a new user needs.
#   make demo        # set up if needed, one pick-and-place episode through the whole stack, a table
#                    # (TASK=stack or TASK=push: a stacking or pushing episode instead)
#   make test        # set up if needed, then lint + the whole test suite (what CI runs)
#   make test-fast   # lint + unit and in-process tests: no DDS, no launch, no slow, no GPU tests
#   make eval        # seeded pick-and-place episodes through the stack: success rate, failures
#   make eval-oracle # the same with the correct plan per goal: everything but the planner's model
#   make eval-stack  # seeded stacking episodes ("stack the red cube on the blue cylinder")
#   make eval-push   # seeded pushing episodes ("push the red cube")
DURATION ?= 30
TASK ?= bin
EPISODES ?= 50

.PHONY: setup demo test test-fast lint clean eval eval-oracle eval-stack eval-push
setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/run.sh python scripts/demo.py --duration $(DURATION) --task $(TASK)

test: setup
	bash scripts/test.sh

test-fast: setup
	bash scripts/test.sh --fast

eval: setup
	bash scripts/run.sh python -m kestrel_bringup.evaluate --episodes $(EPISODES) --seed 0 \
		--out docs/benchmarks/closed_loop_cpu

eval-oracle: setup
	bash scripts/run.sh python -m kestrel_bringup.evaluate --episodes $(EPISODES) --seed 0 \
		--oracle-plan --out docs/benchmarks/closed_loop_oracle_plan_cpu

eval-stack: setup
	bash scripts/run.sh python -m kestrel_bringup.evaluate --task stack --episodes $(EPISODES) \
		--seed 0 --out docs/benchmarks/closed_loop_stack_cpu

eval-push: setup
	bash scripts/run.sh python -m kestrel_bringup.evaluate --task push --episodes $(EPISODES) \
		--seed 0 --out docs/benchmarks/closed_loop_push_cpu

lint: setup
	bash scripts/run.sh ruff check .

clean:
	rm -rf ros2_ws/build ros2_ws/install ros2_ws/log ros2_ws/.kestrel_build
