/* Reference C loop of the Q2_0 signed-d least-squares search (issue 4), single-threaded.
 *
 * Compiled on the fly by benchmarks/bench_quant.py at three flag sets so that the jitted kernel's
 * throughput can be read side by side with a plain C loop of the same search. It is a reference
 * for speed, not for accuracy: the tests check the kernel against a float64 numpy model instead.
 *
 * Build: gcc -O3 [-march=native [-ffast-math]] q2_0_ref.c -o q2_0_ref -lm
 * Run:   ./q2_0_ref N_ROWS N_IN REPEATS WEIGHTS.f32 IMPORTANCE.f32 OUT.bin
 *        reads w [N_ROWS, N_IN] and a per-input-channel importance [N_IN] (raw float32), times
 *        the best of REPEATS passes over all blocks, prints weights/s and writes d (float32,
 *        before fp16 rounding) then q (int8) to OUT.bin.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define QK 64

static const float kSeeds[10] = {0.42f, 0.55f, 0.68f, 0.81f, 0.94f,
                                 -0.42f, -0.55f, -0.68f, -0.81f, -0.94f};

static float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* One block: codes q[64] in {-1,0,1,2} and the scale before fp16 rounding. */
static float quantize_block(const float *w, const float *a, float gain, int8_t *q_out) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(w[i]));
    if (amax == 0.0f) {
        for (int i = 0; i < QK; i++) q_out[i] = 0;
        return 0.0f;
    }
    float best_score = -1.0f, best_d = 0.0f;
    float q[QK], best_q[QK];
    for (int s = 0; s < 10; s++) {
        float d0 = kSeeds[s] * amax;
        float sqw = 0.0f, sqq = 0.0f;
        for (int i = 0; i < QK; i++) {
            q[i] = clampf(rintf(w[i] / d0), -1.0f, 2.0f);
            sqw += a[i] * q[i] * w[i];
            sqq += a[i] * q[i] * q[i];
        }
        float d1 = sqq > 0.0f ? sqw / sqq : d0;
        sqw = 0.0f;
        sqq = 0.0f;
        for (int i = 0; i < QK; i++) {
            q[i] = clampf(rintf(w[i] / d1), -1.0f, 2.0f);
            sqw += a[i] * q[i] * w[i];
            sqq += a[i] * q[i] * q[i];
        }
        float score = sqq > 0.0f ? sqw * sqw / sqq : 0.0f;
        if (score > best_score) {
            best_score = score;
            best_d = sqq > 0.0f ? sqw / sqq : 0.0f;
            for (int i = 0; i < QK; i++) best_q[i] = q[i];
        }
    }
    float saw2 = 0.0f;
    for (int i = 0; i < QK; i++) saw2 += a[i] * w[i] * w[i];
    float r2 = saw2 > 0.0f ? best_score / saw2 : 1.0f;
    for (int i = 0; i < QK; i++) q_out[i] = (int8_t)best_q[i];
    return best_d * powf(fmaxf(r2, 0.25f), -0.5f * gain);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int read_all(const char *path, void *buf, size_t bytes) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t got = fread(buf, 1, bytes, f);
    fclose(f);
    return got == bytes ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s N_ROWS N_IN REPEATS WEIGHTS.f32 IMPORTANCE.f32 OUT.bin\n", argv[0]);
        return 2;
    }
    long n_rows = atol(argv[1]), n_in = atol(argv[2]);
    int repeats = atoi(argv[3]);
    if (n_rows <= 0 || n_in <= 0 || n_in % QK != 0 || repeats <= 0) {
        fprintf(stderr, "bad sizes\n");
        return 2;
    }
    long n_blocks = n_rows * (n_in / QK), nb = n_in / QK;
    float *w = malloc(sizeof(float) * n_rows * n_in);
    float *imp = malloc(sizeof(float) * n_in);
    float *d = malloc(sizeof(float) * n_blocks);
    int8_t *q = malloc((size_t)n_rows * n_in);
    if (!w || !imp || !d || !q) return 3;
    if (read_all(argv[4], w, sizeof(float) * n_rows * n_in) || read_all(argv[5], imp, sizeof(float) * n_in)) {
        fprintf(stderr, "cannot read inputs\n");
        return 3;
    }
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        double t0 = now_s();
        for (long b = 0; b < n_blocks; b++)
            d[b] = quantize_block(w + b * QK, imp + (b % nb) * QK, 0.3f, q + b * QK);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    FILE *f = fopen(argv[6], "wb");
    if (!f || fwrite(d, sizeof(float), n_blocks, f) != (size_t)n_blocks ||
        fwrite(q, 1, (size_t)n_rows * n_in, f) != (size_t)(n_rows * n_in)) {
        fprintf(stderr, "cannot write %s\n", argv[6]);
        return 3;
    }
    fclose(f);
    printf("%.6e\n", (double)(n_rows * n_in) / best);
    free(w); free(imp); free(d); free(q);
    return 0;
}
