# Kestrel: the commands a new user needs.
#   make demo        # set up if needed, run the whole stack on the embedded sim (~30 s), print a table
#   make test        # set up if needed, then lint + the whole test suite (what CI runs)
#   make test-fast   # lint + unit and in-process tests: no DDS, no launch, no slow, no GPU tests
DURATION ?= 30

.PHONY: setup demo test test-fast lint clean
setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/run.sh python scripts/demo.py --duration $(DURATION)

test: setup
	bash scripts/test.sh

test-fast: setup
	bash scripts/test.sh --fast

lint: setup
	bash scripts/run.sh ruff check .

clean:
	rm -rf ros2_ws/build ros2_ws/install ros2_ws/log ros2_ws/.kestrel_build
