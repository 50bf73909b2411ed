# The two commands a newcomer needs (both set everything up on a fresh machine first):
#   make demo   - run the main job (SCAFFOLD) with `nvflare simulator` on real non-IID Fashion-MNIST, summarise it
#   make test   - lint and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_JOBS ?= scaffold

.PHONY: docs setup demo demo-quick demo-compare poc poc-stop deploy bench bench-he bench-agg bench-algorithms bench-genomics bench-latency bench-niid pretrain-attention bench-robust compare test test-fast test-slow test-e2e lint format jobs check-jobs clean

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml scripts/setup_env.sh
	VENV=$(VENV) bash scripts/setup_env.sh
	touch $@

demo: setup
	VENV=$(VENV) bash scripts/demo.sh $(DEMO_JOBS)

# The quick demo (docs/getting_started.md, "Quick versions that still learn"): the demo's job (SCAFFOLD, LeNet-5, SGD
# lr 0.05, 3 sites, Dirichlet 0.5) on 6,000 of the 60,000 training images, batch 16, 5 rounds, scored on the first
# 2,000 test images. Batch 16 gives each site 111-140 steps a round: LeNet-5 with plain SGD stays at chance for its
# first ~60-80 steps, so the naive shortening (--num-rounds 2 --max-train-samples 3000: 13-19 steps a round) ends at
# chance. One process per site (-t 3) with one thread each: with torch's default threads the three sites
# oversubscribed 2 cores and a fit took 18-41 s instead of 1 s. tests/jobs/test_job_quick_setting.py runs this
# target's job in process and checks that it learns. Any Fashion-MNIST job's quick version: its builder line plus
# $(QUICK_ARGS).
QUICK_ARGS := --num-rounds 5 --max-train-samples 6000 --batch-size 16 --max-test-samples 2000
QUICK_JOBS ?= /tmp/fl-demo/jobs
demo-quick: setup
	$(PY) -m jobs.build --client scaffold --server scaffold --name scaffold_quick --output-dir $(QUICK_JOBS) $(QUICK_ARGS)
	OMP_NUM_THREADS=1 DEMO_JOBS_DIR=$(QUICK_JOBS) THREADS=3 VENV=$(VENV) bash scripts/demo.sh scaffold_quick

demo-compare: setup
	VENV=$(VENV) bash scripts/demo.sh scaffold fedavg

# A real deployment on this machine (docs/deployment.md): provision, start server + POC_SITES sites, submit, wait, stop;
# it prints the global model's final test accuracy and the report command. By default it runs the quick demo's job
# (built here with demo-quick's builder line into POC_JOBS, not demo-quick's folder): each site gets the job's own
# shard, so the deployment trains the model the simulator does (measured: 0.681 after round 5, chance 0.1, as
# make demo-quick; tests/jobs/test_job_quick_setting.py checks that this target runs that job). With the committed
# jobs/scaffold and the driver's 3,000 samples it stayed at chance for 3 rounds (0.454 after round 10).
# POC_JOB=jobs/fedavg_he, or a QC job exported with --secure-aggregation he: the kits get HEBuilder's contexts by
# themselves. POC_ARGS goes to the driver, e.g. each site's genotype files for the federated QC (docs/deployment.md):
#   make poc POC_JOB=/tmp/jobs/genotype_qc POC_SITES=5 POC_ARGS="--genotypes /data/{site}.npz --snp-table /data/table.csv"
# POC_ARGS=--keep leaves the deployment running; make poc-stop stops it.
POC_JOBS ?= /tmp/fedalg-poc-jobs
POC_QUICK_JOB := $(POC_JOBS)/scaffold_quick
POC_BUILD := $(PY) -m jobs.build --client scaffold --server scaffold --name scaffold_quick --output-dir $(POC_JOBS) $(QUICK_ARGS)
POC_JOB ?= $(POC_QUICK_JOB)
POC_WS ?= /tmp/fedalg-loopback
POC_SITES ?= 3
POC_ARGS ?=
poc: setup
	rm -rf $(POC_WS)
	$(if $(filter $(POC_QUICK_JOB),$(POC_JOB)),$(POC_BUILD))
	OMP_NUM_THREADS=1 $(PY) -m jobs.provision.loopback $(POC_JOB) --workspace $(POC_WS) --sites $(POC_SITES) $(POC_ARGS)

poc-stop: setup
	$(PY) -m jobs.provision.loopback --stop $(POC_WS)

# Runtime kits for containers and clusters (docs/deployment.md, section 11): provision jobs/provision/project.yml,
# then `nvflare deploy prepare` every server and site kit for RUNTIME (docker, k8s or slurm) with the bundle's config
# in jobs/provision/runtimes/ (or DEPLOY_CONFIG), into $(DEPLOY_WS)/$(RUNTIME)/<participant>/.
RUNTIME ?= docker
DEPLOY_WS ?= /tmp/fedalg-deploy
DEPLOY_PROJECT ?= jobs/provision/project.yml
deploy: setup
	rm -rf $(DEPLOY_WS)
	$(VENV)/bin/nvflare provision -p $(DEPLOY_PROJECT) -w $(DEPLOY_WS)/provision
	$(PY) -m jobs.provision.deploy --runtime $(RUNTIME) $(if $(DEPLOY_CONFIG),--config $(DEPLOY_CONFIG)) \
		--kits $(DEPLOY_WS)/provision --out $(DEPLOY_WS)/$(RUNTIME)

bench: setup
	$(PY) -m benchmarks.step_overhead

# What homomorphic encryption costs per round (docs/deployment.md, "Secure aggregation (HE)"): the same FedAvg job
# with and without NVFlare's HE components, alternating on one loopback deployment provisioned with HEBuilder.
bench-he: setup
	$(PY) -m benchmarks.secure_aggregation --modes plain,he --rounds 5 --repeats 3 --max-train-samples 3000 --out benchmarks/results/secure_aggregation.md

# The genomics results (docs/genomics.md): federated algorithms vs local-only and pooled training, 3 seeds each.
bench-genomics: setup
	$(PY) -m benchmarks.genomics --source 1kg --out benchmarks/results/genomics_1kg
	$(PY) -m benchmarks.genomics --source sim --rounds 20 --out benchmarks/results/genomics_sim

bench-agg: setup
	$(PY) -m benchmarks.aggregation

# Round latency in `nvflare simulator -t 3` (waiting per round, NVFlare's defaults vs the exported jobs) and a site's
# start-up under -t 1 (docs/deployment.md, "Round latency and start-up").
bench-latency: setup
	$(PY) -m benchmarks.round_overhead
	$(PY) -m benchmarks.startup --simulate

# NIID-Bench's Fashion-MNIST table on the reduced protocol of benchmarks/results/niid_bench.md (20 cells; 8 of
# them took 6 min on 2 CPU cores); NIID_FULL=1 runs the full protocol (40-45 min of one core per cell here).
NIID_OUT ?= runs/niid_bench
NIID_REDUCED := $(if $(NIID_FULL),,--rounds 10 --max-train-samples 12000 --test-samples 2000)
bench-niid: setup
	$(PY) -m benchmarks.compare --grid niid_bench --out $(NIID_OUT) $(NIID_REDUCED)

# FedMoS and MOON (docs/fedmos_moon.md): step time vs plain SGD and client memory per site.
bench-algorithms: setup
	$(PY) -m benchmarks.client_algorithms

# Attack-adaptive aggregation (docs/robustness.md): capture rounds -> pretrain the shipped attention checkpoint,
# then the robustness grid (final accuracy per rule x attack x share of malicious sites).
CAPTURE_DIR ?= /tmp/fedalg_aaa_capture
pretrain-attention: setup
	rm -rf $(CAPTURE_DIR)
	$(PY) -m benchmarks.robustness --capture-dir $(CAPTURE_DIR) --rules median,trimmed_mean --seed 1
	$(PY) -m aggregators.pretrain_attention --dataset-dir $(CAPTURE_DIR) --save-path aggregators/checkpoints/attention_lenet5.pt --epochs 300 --learning-rate 3e-3

# Resumable: finished cells are kept in $(ROBUST_OUT)/cells; rerun to continue, or add seeds (ROBUST_SEEDS=0,1,2).
ROBUST_OUT ?= benchmarks/results/robustness
ROBUST_SEEDS ?= 0,1,2
bench-robust: setup
	$(PY) -m benchmarks.robustness --out-dir $(ROBUST_OUT) --seeds $(ROBUST_SEEDS) --out benchmarks/results/robustness.md --plot docs/img/robustness.png

# Every algorithm on the same non-IID splits, several seeds (docs: benchmarks/README.md). Resumable: rerun to continue.
COMPARE_OUT ?= runs/compare
compare: setup
	$(PY) -m benchmarks.compare --out $(COMPARE_OUT)

# --durations=30: every CI log ends with the 30 slowest tests of each part (CI must stay under 45 min on 2 cores).
# OMP_WAIT_POLICY=PASSIVE: torch's idle OpenMP threads sleep instead of spinning; with more busy threads than cores
# (the simulator's sites, a shared runner) a spinning LeNet-5 step took 20-50x longer here (no result changes).
# Two parts: everything outside tests/e2e on two pytest-xdist workers (4 min 44 s against 7-8 min in one process),
# then tests/e2e on E2E_WORKERS workers (E2E_WORKERS=0: one process). An end-to-end run alone keeps about one core
# busy (the simulator's sites mostly wait), so two at once use both cores; --dist loadgroup keeps the tests that share a simulator run or a deployment on one worker (the
# work units of tests/conftest.py's scheduler), and every run has its own workspace and ports. Times: docs/results.md,
# "Test tiers" (FL_RECORD_TEST_SECONDS=<file.json> writes each test's time).
E2E_WORKERS ?= 2
E2E_PARALLEL := -n $(E2E_WORKERS) --dist loadgroup
test: setup lint
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest --ignore=tests/e2e -n 2 --dist loadgroup --durations=30
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest tests/e2e $(E2E_PARALLEL) --durations=30

# The test pyramid (tiers assigned in tests/conftest.py; times in docs/results.md, "Test tiers"):
#   test-fast - unit and contract tests: no simulator, no training subprocess, no multi-process run (minutes)
#   test-slow - the slow tests outside tests/e2e: in-process training, client processes, SimEnv
#   test-e2e  - tests/e2e: `nvflare simulator` and provisioned loopback deployments, on E2E_WORKERS workers
test-fast: setup
	$(PY) -m pytest -m "not slow" --ignore=tests/e2e --durations=15

test-slow: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -m "slow and not e2e" --ignore=tests/e2e --durations=15

test-e2e: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest tests/e2e $(E2E_PARALLEL) --durations=15

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The documentation site (mkdocs.yml) into site/, with --strict: a broken link or page fails. Open site/index.html.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

jobs: setup
	$(PY) -m jobs.build --presets

check-jobs: setup
	$(PY) -m jobs.build --presets --check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
