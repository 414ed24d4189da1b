/* torchhal_speedups._guards: the kernel registry's memo guard (torchhal/hal_core/dispatch_memo.py,
 * `_Guard` and `_python_first_admitted`) in C.
 *
 * Why it exists: every memoised op call checks its op's recent argument layouts with these guards
 * before running a kernel. In Python the guard's own frames and loops cost about 0.9 µs a call,
 * twice torch's C++ tensor check it ends with, and most of what keeps slower hosts above the
 * 3 µs-per-op dispatch target. The semantics are the Python guard's, exactly; that one stays the
 * reference and the fallback where this module is not installed.
 *
 * CPython limited API (abi3, 3.10+) and no torch headers: torch's check is a Python callable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject *guard_type;
    PyObject *is_nested;     /* interned attribute names */
    PyObject *requires_grad;
} State;

typedef struct {
    PyObject_HEAD
    PyObject *route;
    PyObject *check;         /* torch's TensorGuards(...).check */
    PyObject *values;        /* tuple: the scalars, in position order */
    PyObject *types;         /* tuple: each scalar's exact type */
    Py_ssize_t arity;
    Py_ssize_t n_scalars;
    Py_ssize_t n_tensors;
    Py_ssize_t *scalar_at;   /* n_scalars positions; tensor_at's n_tensors follow at [arity] */
    Py_ssize_t *tensor_at;
    char requires_grad;
} Guard;

/* A new reference to `guard.admits(route, args)`'s answer: Py_False, or the check's result; NULL
 * with an exception set. `args` must be a tuple. */
static PyObject *
admits(Guard *g, State *st, PyObject *route, PyObject *args)
{
    /* route first: tp_clear leaves route NULL, and nothing else is read then */
    if (route != g->route || PyTuple_Size(args) != g->arity)
        Py_RETURN_FALSE;
    /* types before values: True == 1 == 1.0, and an argument's own == must never run */
    for (Py_ssize_t i = 0; i < g->n_scalars; i++) {
        PyObject *arg = PyTuple_GetItem(args, g->scalar_at[i]);
        if ((PyObject *)Py_TYPE(arg) != PyTuple_GetItem(g->types, i))
            Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < g->n_scalars; i++) {
        int eq = PyObject_RichCompareBool(PyTuple_GetItem(args, g->scalar_at[i]),
                                          PyTuple_GetItem(g->values, i), Py_EQ);
        if (eq <= 0)
            return eq < 0 ? NULL : Py_NewRef(Py_False);
    }
    /* torch's check reads strides, and a strided nested tensor aborts the process there */
    for (Py_ssize_t i = 0; i < g->n_tensors; i++) {
        PyObject *nested = PyObject_GetAttr(PyTuple_GetItem(args, g->tensor_at[i]), st->is_nested);
        int truth = nested == NULL ? -1 : PyObject_IsTrue(nested);
        Py_XDECREF(nested);
        if (truth < 0) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return NULL;
            PyErr_Clear();  /* no tensor where the guard has one */
            Py_RETURN_FALSE;
        }
        if (truth)
            Py_RETURN_FALSE;
    }
    PyObject *tensors = PyTuple_New(g->n_tensors);
    if (tensors == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < g->n_tensors; i++)
        PyTuple_SetItem(tensors, i, Py_NewRef(PyTuple_GetItem(args, g->tensor_at[i])));
    PyObject *verdict = PyObject_Call(g->check, tensors, NULL);
    Py_DECREF(tensors);
    return verdict;
}

/* An exact tuple: its items are read from its storage, which a subclass's __len__ or
 * __getitem__ would not see (the Python guard would). Every registry caller passes one. */
static int
need_tuple(PyObject *obj, const char *what)
{
    if (PyTuple_CheckExact(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a tuple, not %R", what, (PyObject *)Py_TYPE(obj));
    return -1;
}

static PyObject *
Guard_admits(Guard *self, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc != 2) {
        PyErr_Format(PyExc_TypeError, "admits() takes 2 arguments (%zd given)", argc);
        return NULL;
    }
    if (need_tuple(argv[1], "args") < 0)
        return NULL;
    return admits(self, PyType_GetModuleState(Py_TYPE(self)), argv[0], argv[1]);
}

/* Guard(route, args, tensor_at, check), as `_Guard` is made */
static PyObject *
Guard_new(PyTypeObject *type, PyObject *posargs, PyObject *kwargs)
{
    static char *names[] = {"route", "args", "tensor_at", "check", NULL};
    PyObject *route, *args, *tensor_at, *check;
    if (!PyArg_ParseTupleAndKeywords(posargs, kwargs, "OOOO:Guard", names, &route, &args, &tensor_at,
                                     &check) ||
        need_tuple(args, "args") < 0)  /* a subclass's __len__ would go unread, as in `admits` */
        return NULL;
    State *st = PyType_GetModuleState(type);
    Py_ssize_t arity = PyTuple_Size(args);
    PyObject *at = PySequence_Tuple(tensor_at);
    if (at == NULL)
        return NULL;
    Py_ssize_t n_tensors = PyTuple_Size(at);
    Guard *g = (Guard *)PyType_GenericAlloc(type, 0);  /* zeroed; tracked by the collector */
    Py_ssize_t *positions = PyMem_Calloc(arity + n_tensors + 1, sizeof(Py_ssize_t));
    char *is_tensor = PyMem_Calloc(arity + 1, 1);
    if (g == NULL || positions == NULL || is_tensor == NULL) {
        if (g != NULL)
            PyErr_NoMemory();
        goto fail;
    }
    g->scalar_at = positions;  /* freed by Guard_dealloc from now on */
    g->tensor_at = positions + arity;
    g->check = Py_NewRef(check);
    g->arity = arity;
    g->n_tensors = n_tensors;
    for (Py_ssize_t i = 0; i < n_tensors; i++) {
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GetItem(at, i));
        if (pos == -1 && PyErr_Occurred())
            goto fail;
        if (pos < 0 || pos >= arity || is_tensor[pos]) {
            PyErr_Format(PyExc_ValueError, "tensor_at: %zd is out of range or repeated", pos);
            goto fail;
        }
        is_tensor[pos] = 1;
        g->tensor_at[i] = pos;
    }
    g->n_scalars = arity - n_tensors;
    g->values = PyTuple_New(g->n_scalars);
    g->types = PyTuple_New(g->n_scalars);
    if (g->values == NULL || g->types == NULL)
        goto fail;
    for (Py_ssize_t pos = 0, i = 0; pos < arity; pos++) {
        if (is_tensor[pos])
            continue;
        PyObject *value = PyTuple_GetItem(args, pos);
        g->scalar_at[i] = pos;
        if (PyTuple_SetItem(g->values, i, Py_NewRef(value)) < 0 ||
            PyTuple_SetItem(g->types, i, Py_NewRef((PyObject *)Py_TYPE(value))) < 0)
            goto fail;
        i++;
    }
    for (Py_ssize_t i = 0; i < n_tensors && !g->requires_grad; i++) {  /* the check holds it to this */
        PyObject *flag = PyObject_GetAttr(PyTuple_GetItem(args, g->tensor_at[i]), st->requires_grad);
        int truth = flag == NULL ? -1 : PyObject_IsTrue(flag);
        Py_XDECREF(flag);
        if (truth < 0)
            goto fail;
        g->requires_grad = (char)truth;
    }
    PyMem_Free(is_tensor);
    Py_DECREF(at);
    /* the route last: the collector may find the guard while it is made (an allocation above can
     * run a finalizer), and `admits` reads nothing else while the route is unset */
    g->route = Py_NewRef(route);
    return (PyObject *)g;
fail:
    if (g == NULL || g->scalar_at == NULL)
        PyMem_Free(positions);
    PyMem_Free(is_tensor);
    Py_DECREF(at);
    Py_XDECREF(g);
    return NULL;
}

static int
Guard_traverse(Guard *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->route);
    Py_VISIT(self->check);
    Py_VISIT(self->values);
    Py_VISIT(self->types);
    return 0;
}

static int
Guard_clear(Guard *self)
{
    Py_CLEAR(self->route);
    Py_CLEAR(self->check);
    Py_CLEAR(self->values);
    Py_CLEAR(self->types);
    return 0;
}

static void
Guard_dealloc(Guard *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Guard_clear(self);
    PyMem_Free(self->scalar_at);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(self);
    Py_DECREF(type);
}

/* ((position, type), ...), as `_Guard.scalar_types` holds them */
static PyObject *
Guard_scalar_types(Guard *self, void *closure)
{
    if (self->types == NULL)
        return PyTuple_New(0);
    PyObject *pairs = PyTuple_New(self->n_scalars);
    for (Py_ssize_t i = 0; pairs != NULL && i < self->n_scalars; i++) {
        PyObject *pair = Py_BuildValue("(nO)", self->scalar_at[i], PyTuple_GetItem(self->types, i));
        if (pair == NULL || PyTuple_SetItem(pairs, i, pair) < 0)
            Py_CLEAR(pairs);
    }
    return pairs;
}

static PyObject *
Guard_requires_grad(Guard *self, void *closure)
{
    return PyBool_FromLong(self->requires_grad);
}

static PyMethodDef Guard_methods[] = {
    {"admits", (PyCFunction)(void (*)(void))Guard_admits, METH_FASTCALL,
     "admits(route, args): whether a call may reuse this layout's memo entry (see `_Guard`)"},
    {NULL},
};

static PyMemberDef Guard_members[] = {
    {"route", T_OBJECT, offsetof(Guard, route), READONLY, NULL},
    {"check", T_OBJECT, offsetof(Guard, check), READONLY, NULL},
    {"values", T_OBJECT, offsetof(Guard, values), READONLY, NULL},
    {"arity", T_PYSSIZET, offsetof(Guard, arity), READONLY, NULL},
    {NULL},
};

static PyGetSetDef Guard_getset[] = {
    {"scalar_types", (getter)Guard_scalar_types, NULL, NULL, NULL},
    {"requires_grad", (getter)Guard_requires_grad, NULL, NULL, NULL},
    {NULL},
};

static PyType_Slot Guard_slots[] = {
    {Py_tp_doc, "The memo guard of torchhal.hal_core.dispatch_memo._Guard, in C: Guard(route, args, tensor_at, check)."},
    {Py_tp_new, Guard_new},
    {Py_tp_dealloc, Guard_dealloc},
    {Py_tp_traverse, Guard_traverse},
    {Py_tp_clear, Guard_clear},
    {Py_tp_methods, Guard_methods},
    {Py_tp_members, Guard_members},
    {Py_tp_getset, Guard_getset},
    {0, NULL},
};

static PyType_Spec Guard_spec = {
    "torchhal_speedups._guards.Guard", sizeof(Guard), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE, Guard_slots,
};

/* first_admitted(recent, route, args, grad_free_only): the hit of the first (guard, hit) pair of
 * `recent` whose guard admits (route, args), skipping guards of tensors that required grad when
 * `grad_free_only`; None if none does. */
static PyObject *
first_admitted(PyObject *module, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc != 4) {
        PyErr_Format(PyExc_TypeError, "first_admitted() takes 4 arguments (%zd given)", argc);
        return NULL;
    }
    PyObject *recent = argv[0], *route = argv[1], *args = argv[2];
    if (need_tuple(recent, "recent") < 0 || need_tuple(args, "args") < 0)
        return NULL;
    int grad_free_only = PyObject_IsTrue(argv[3]);
    if (grad_free_only < 0)
        return NULL;
    State *st = PyModule_GetState(module);
    Py_ssize_t n = PyTuple_Size(recent);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyTuple_GetItem(recent, i);
        if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2 ||
            (PyObject *)Py_TYPE(PyTuple_GetItem(pair, 0)) != st->guard_type) {
            PyErr_SetString(PyExc_TypeError, "recent must hold (Guard, hit) pairs");
            return NULL;
        }
        Guard *g = (Guard *)PyTuple_GetItem(pair, 0);
        if (grad_free_only && g->requires_grad)
            continue;
        PyObject *verdict = admits(g, st, route, args);
        int truth = verdict == NULL ? -1 : PyObject_IsTrue(verdict);
        Py_XDECREF(verdict);
        if (truth < 0)
            return NULL;
        if (truth)
            return Py_NewRef(PyTuple_GetItem(pair, 1));
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"first_admitted", (PyCFunction)(void (*)(void))first_admitted, METH_FASTCALL,
     "first_admitted(recent, route, args, grad_free_only): the first admitted pair's hit, or None"},
    {NULL},
};

static int
module_exec(PyObject *module)
{
    State *st = PyModule_GetState(module);
    st->is_nested = PyUnicode_InternFromString("is_nested");
    st->requires_grad = PyUnicode_InternFromString("requires_grad");
    if (st->is_nested == NULL || st->requires_grad == NULL)
        return -1;
    st->guard_type = PyType_FromModuleAndSpec(module, &Guard_spec, NULL);
    if (st->guard_type == NULL)
        return -1;
    return PyModule_AddObjectRef(module, "Guard", st->guard_type);
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    State *st = PyModule_GetState(module);
    Py_VISIT(st->guard_type);
    return 0;
}

static int
module_clear(PyObject *module)
{
    State *st = PyModule_GetState(module);
    Py_CLEAR(st->guard_type);
    Py_CLEAR(st->is_nested);
    Py_CLEAR(st->requires_grad);
    return 0;
}

static void
module_free(void *module)
{
    module_clear(module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "torchhal_speedups._guards", NULL, sizeof(State), module_methods,
    module_slots, module_traverse, module_clear, module_free,
};

PyMODINIT_FUNC
PyInit__guards(void)
{
    return PyModuleDef_Init(&module_def);
}
